"""One HTTP POST to the endpoint, with the standard library's http.client (no extra package: a worker needs
nothing beyond jobrunner's own dependencies; one blocking call per sending thread is all the engine needs).
A connection per request (`Connection: close`): a dropped or half-read connection is never reused."""

from __future__ import annotations

import email.utils
import http.client
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# what a dropped connection, a reset or a cut answer raises (all retried)
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)


@dataclass
class Reply:
    """The server's answer: status, headers (lower-case names) and body."""

    status: int
    headers: dict[str, str]
    body: bytes
    first_token_time: float | None = None  # a streamed answer: when its first text came (time.perf_counter)

    def retry_after_s(self) -> float | None:
        """What the server asks to wait before trying again (`retry-after-ms`, `retry-after`: seconds or an
        HTTP date), or None."""
        ms = self.headers.get("retry-after-ms")
        if ms is not None:
            try:
                return max(0.0, float(ms) / 1000.0)
            except ValueError:
                pass
        value = self.headers.get("retry-after")
        if value is None:
            return None
        try:
            return max(0.0, float(value))
        except ValueError:
            when = email.utils.parsedate_to_datetime(value) if value.strip() else None
            return None if when is None else max(0.0, when.timestamp() - time.time())


class Transport:
    """POSTs JSON under one base URL (`http(s)://host[:port]/prefix`), with the API key as a bearer token."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine.endpoint.base_url {base_url!r} is not an http(s) URL")
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._timeout_s = timeout_s
        self._headers = {"Content-Type": "application/json", "Accept": "application/json", "Connection": "close"}
        self._api_key = api_key or ""
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._context = ssl.create_default_context() if self._https else None

    def post(self, path: str, body: dict[str, Any], on_sent: Callable[[], None] | None = None) -> Reply:
        """The answer to one POST; raises a TRANSPORT_ERRORS exception when the connection fails or drops. A
        body with `stream: true` is read as server-sent events and handed back as the one JSON answer a
        non-streamed request gets (wire.assemble_stream), with the time its first text came. `on_sent` is
        called once the request is written (the server has it from then on, give or take the network)."""
        data = json.dumps(body).encode("utf-8")
        conn = self._connect()
        try:
            conn.request("POST", self._prefix + path, body=data, headers=self._headers)
            if on_sent is not None:
                on_sent()
            response = conn.getresponse()
            headers = {k.lower(): v for k, v in response.getheaders()}
            if response.status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
                answer, first = _read_events(response)
                return Reply(200, headers, json.dumps(answer).encode("utf-8"), first)
            return Reply(response.status, headers, response.read())
        finally:
            conn.close()

    def get(self, path: str) -> Reply:
        """The answer to one GET (e.g. /models); raises a TRANSPORT_ERRORS exception as `post` does."""
        conn = self._connect()
        try:
            headers = {k: v for k, v in self._headers.items() if k != "Content-Type"}
            conn.request("GET", self._prefix + path, headers=headers)
            response = conn.getresponse()
            return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
        finally:
            conn.close()

    def cut_key(self, text: str) -> str:
        """`text` without the API key (a server's message may quote it)."""
        return text.replace(self._api_key, "***") if self._api_key else text

    def _connect(self) -> http.client.HTTPConnection:
        if self._https:
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout_s, context=self._context)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        return conn


def _read_events(response: http.client.HTTPResponse) -> tuple[dict[str, Any], float | None]:
    """A server-sent-events answer read to its end ([DONE] or the connection's end, which a cut stream
    reaches early: its error is raised as a dropped connection): the assembled answer, first text's time."""
    from jobrunner.endpoint_backend.wire import assemble_stream

    events, first, done = [], None, False
    for raw in response:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        event = json.loads(payload)
        events.append(event)
        if first is None and any(_has_text(c) for c in event.get("choices") or ()):
            first = time.perf_counter()
    if not done:
        raise http.client.IncompleteRead(b"", None)  # the stream was cut before [DONE]
    return assemble_stream(events), first


def _has_text(chunk: dict[str, Any]) -> bool:
    delta = chunk.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
    return bool(chunk.get("text"))
