"""An HTTP proxy in front of a real Ray dashboard that drops the connections of chosen requests, as a busy or
restarting dashboard (or a load balancer between) does: the client sees the connection closed with no answer.

`rule(method, path)` says what to do with each request: None forwards it; "before" closes the connection
without forwarding (the head never saw it); "after" forwards it, then closes without relaying the answer (the
head acted on it; only its reply is lost).
"""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Rule = Callable[[str, str], "str | None"]


class DroppingProxy:
    """Serves on 127.0.0.1 (`url`); forwards to `target` except where `rule` drops; `seen` lists
    (method, path, action) for every request."""

    def __init__(self, target: str, rule: Rule | None = None) -> None:
        self.target = target.rstrip("/")
        self.rule: Rule = rule or (lambda method, path: None)
        self.seen: list[tuple[str, str, str]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                action = proxy.rule(self.command, self.path) or "forward"
                proxy.seen.append((self.command, self.path, action))
                if action == "before":
                    return self._drop()
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                request = urllib.request.Request(proxy.target + self.path, data=body or None, headers=headers,
                                                 method=self.command)
                try:
                    with urllib.request.urlopen(request, timeout=60) as answer:
                        status, answer_headers, payload = answer.status, answer.headers, answer.read()
                except urllib.error.HTTPError as error:
                    status, answer_headers, payload = error.code, error.headers, error.read()
                if action == "after":
                    return self._drop()
                self.send_response(status)
                for key, value in answer_headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _drop(self) -> None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> DroppingProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def drop_first(method: str, prefix: str, how: str, count: int = 1) -> Rule:
    """A rule dropping (`how`) the first `count` requests of `method` whose path starts with `prefix`."""
    left = [count]

    def rule(request_method: str, path: str) -> str | None:
        if request_method == method and path.startswith(prefix) and left[0] > 0:
            left[0] -= 1
            return how
        return None

    return rule
