"""A tiny OpenAI-compatible server on 127.0.0.1 for the job-level fault tests: it checks the bearer key and the
model as a real server does (401 `Incorrect API key`, 404 `The model ... does not exist`, 404 `Not Found` off
its /v1 paths, 400 for a prompt saying "too long"), lists its models at GET /v1/models, and answers every
other chat / completion with "ok" (usage 5 + 1 tokens). No model runs: the faults are about the URL, key and
model, not the text."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "tiny"


class TinyServer:
    """The server (a context manager); `url` is its base URL with /v1, `posts` counts the POSTs it answered,
    `bodies` holds their JSON bodies in the order they came."""

    def __init__(self, key: str) -> None:
        self.key, self.posts, self.lock = key, 0, threading.Lock()
        self.bodies: list[dict] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="tiny-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> TinyServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler(server: TinyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path != "/v1/models":
                self._answer(404, {"detail": "Not Found"})
            else:
                self._answer(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            with server.lock:
                server.posts += 1
                server.bodies.append(body)
            if self.headers.get("Authorization") != f"Bearer {server.key}":
                self._answer(401, {"error": {"message": "Incorrect API key provided", "code": "invalid_api_key"}})
            elif self.path not in ("/v1/chat/completions", "/v1/completions"):
                self._answer(404, {"detail": "Not Found"})
            elif body.get("model") != MODEL:
                self._answer(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                             "type": "NotFoundError", "code": 404}})
            elif "too long" in json.dumps(body):
                self._answer(400, {"error": {"message": "this prompt is too long", "code": 400}})
            elif self.path == "/v1/chat/completions":
                self._answer(200, _answer({"message": {"role": "assistant", "content": "ok"}}))
            else:
                self._answer(200, _answer({"text": "ok"}))

        def _answer(self, status: int, data: dict) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(raw)

    return Handler


def _answer(choice: dict) -> dict:
    return {"choices": [{"index": 0, "finish_reason": "stop", **choice}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}


def closed_port_url() -> str:
    """A base URL where nothing listens (a port just bound and let go)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
