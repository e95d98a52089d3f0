"""A fault-injecting reverse proxy on 127.0.0.1 in front of an OpenAI-compatible server (tests, benchmarks).

Each request is, by a seeded draw: answered 429 with `Retry-After` (share `rate_429`), answered 503
(`rate_503`), dropped without an answer (`rate_drop`: the connection is closed after the request is read), or
forwarded to the server, after `slow_s` seconds for a share `rate_slow`. Faults are decided before the
server sees the request, so the server's load is what the proxy forwards. Every request is recorded
(`records`): its arrival time, what the proxy did, and for a forwarded one the usage tokens the server
answered, so a test can measure requests and tokens per minute at the server (`max_in_window`).
`expect_key`: a request without `Authorization: Bearer <it>` is answered 401; `always_429`: a request whose
body holds this text is always answered 429 (one row's retries run out).
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


@dataclass
class Record:
    """One request the proxy received."""

    time: float  # time.monotonic() at arrival
    path: str
    outcome: str  # forwarded, 429, 503, dropped, 401
    status: int | None = None  # the server's status (forwarded)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    body: dict = field(default_factory=dict)
    answered: float | None = None  # time.monotonic() when the server's answer came (forwarded)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class FaultProxy:
    """The proxy; `url` is its base URL (with the upstream's path prefix, e.g. /v1). A context manager."""

    def __init__(self, upstream: str, seed: int = 0, rate_429: float = 0.0, retry_after: str | None = "1",
                 rate_503: float = 0.0, rate_drop: float = 0.0, rate_slow: float = 0.0, slow_s: float = 1.0,
                 expect_key: str | None = None, always_429: str | None = None) -> None:
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port, self.prefix = parts.hostname, parts.port, parts.path.rstrip("/")
        self.rate_429, self.retry_after, self.rate_503 = rate_429, retry_after, rate_503
        self.rate_drop, self.rate_slow, self.slow_s, self.expect_key = rate_drop, rate_slow, slow_s, expect_key
        self.always_429 = always_429
        self.records: list[Record] = []
        self.lock = threading.Lock()
        self._random = random.Random(seed)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{self.prefix}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def set_faults(self, **rates: float | str | None) -> None:
        """Change the fault shares (rate_429=..., retry_after=..., ...) and forget the records."""
        with self.lock:
            for name, value in rates.items():
                if not hasattr(self, name):
                    raise AttributeError(name)
                setattr(self, name, value)
            self.records = []

    def draw(self) -> str:
        """What to do with the next request: 429, 503, dropped, slow or forward."""
        with self.lock:
            x = self._random.random()
        for outcome, share in (("429", self.rate_429), ("503", self.rate_503), ("dropped", self.rate_drop),
                               ("slow", self.rate_slow)):
            if x < share:
                return outcome
            x -= share
        return "forward"

    def forwarded(self) -> list[Record]:
        with self.lock:
            return [r for r in self.records if r.outcome == "forwarded"]

    def forward(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, list, bytes]:
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=600)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status, headers, body = proxy.forward("GET", self.path, b"", {})
            self._answer(status, body, {k: v for k, v in headers if k.lower() == "content-type"})

        def do_POST(self) -> None:  # noqa: N802
            arrival = time.monotonic()
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            try:
                request = json.loads(body)
            except ValueError:
                request = {}
            record = Record(arrival, self.path, "", body=request)
            if proxy.expect_key is not None and self.headers.get("Authorization") != f"Bearer {proxy.expect_key}":
                record.outcome = "401"
                self._record(record)
                self._answer(401, _error("no valid API key"), {})
                return
            outcome = proxy.draw()
            if proxy.always_429 is not None and proxy.always_429.encode() in body:
                outcome = "429"
            if outcome == "429":
                record.outcome = "429"
                self._record(record)
                extra = {"Retry-After": proxy.retry_after} if proxy.retry_after is not None else {}
                self._answer(429, _error("rate limited by the fault proxy"), extra)
                return
            if outcome == "503":
                record.outcome = "503"
                self._record(record)
                self._answer(503, _error("the fault proxy is overloaded"), {})
                return
            if outcome == "dropped":
                record.outcome = "dropped"
                self._record(record)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if outcome == "slow":
                time.sleep(proxy.slow_s)
            record.time = time.monotonic()  # the server's arrival
            record.outcome = "forwarded"
            headers = {"Content-Type": "application/json"}
            status, _, answer = proxy.forward("POST", self.path, body, headers)
            record.status, record.answered = status, time.monotonic()
            try:
                usage = json.loads(answer).get("usage") or {}
                record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                record.completion_tokens = int(usage.get("completion_tokens") or 0)
            except (ValueError, AttributeError):
                pass
            self._record(record)
            self._answer(status, answer, {})

        def _record(self, record: Record) -> None:
            with proxy.lock:
                proxy.records.append(record)

        def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers.items():
                if name.lower() != "content-type":
                    self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    return Handler


def _error(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "fault_proxy"}}).encode()


def max_in_window(records: list[Record], window_s: float = 60.0, tokens: bool = False) -> float:
    """The most requests (or tokens: prompt + completion) that arrived within any `window_s` seconds."""
    points = sorted((r.time, r.tokens if tokens else 1) for r in records)
    best, total, start = 0.0, 0.0, 0
    for end, (t, value) in enumerate(points):
        total += value
        while points[start][0] <= t - window_s:
            total -= points[start][1]
            start += 1
        best = max(best, total)
        del end
    return best
