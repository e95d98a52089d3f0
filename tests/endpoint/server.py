"""vLLM's own OpenAI-compatible server (`vllm.entrypoints.openai.api_server`, from the Python that has vLLM) on
the embedded SmolLM2 model, float32, CPU, on a free port of 127.0.0.1: started, waited for (/health, with a
deadline), stopped. One engine process (no engine-core or executor processes of its own): it starts in about
half the time. Used by the endpoint tests and scripts/endpoint_bench.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from jobrunner.vllm_backend.mapping import cpu_preload

SERVED_NAME = "smollm2"
START_DEADLINE_S = 300.0


@dataclass
class VllmServer:
    """A running server: its base URL (…/v1), the model name it serves, its log, its model directory."""

    url: str
    model: str
    log_path: str
    model_dir: str
    proc: subprocess.Popen

    def stop(self) -> None:
        """Stop the server and everything it started (its own process group)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_vllm_server(python: str, model_dir: str, threads: int = 2, max_num_seqs: int = 32) -> VllmServer:
    """Start the server and wait until /health answers 200 (RuntimeError with its log's tail otherwise)."""
    port = free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"jobrunner-endpoint-vllm-{port}.log")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(threads)}
    preload = cpu_preload(python)
    if preload:
        env["LD_PRELOAD"] = preload
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048", "--served-model-name",
               SERVED_NAME, "--enforce-eager", "--seed", "0", "--distributed-executor-backend", "uni",
               "--max-num-seqs", str(max_num_seqs)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = VllmServer(f"http://127.0.0.1:{port}/v1", SERVED_NAME, log_path, model_dir, proc)
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited ({proc.returncode}); its log ends: {_tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"vLLM's server did not answer /health within {START_DEADLINE_S:g} s: {_tail(log_path)}")


def _tail(path: str) -> str:
    lines = Path(path).read_text(errors="replace").splitlines()
    return " | ".join(lines[-8:])
