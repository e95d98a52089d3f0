"""The vLLM server process ends with its worker: `watch_parent` exits the process once its parent is gone (a
step hung inside vLLM never reads its closed pipe). Needs no vLLM: the server imports it only to start."""

from __future__ import annotations

import subprocess
import sys
import time

from jobrunner.vllm_backend.engine import SERVER

WATCH = ("import sys, time; sys.path.insert(0, {folder!r}); import server; "
         "server.watch_parent({parent}, interval_s=0.05); time.sleep(30)")


def test_the_server_exits_once_its_parent_is_gone():
    started = time.monotonic()
    orphan = subprocess.run([sys.executable, "-c", WATCH.format(folder=str(SERVER.parent), parent=1)],
                            timeout=20, check=False)
    assert orphan.returncode == 0 and time.monotonic() - started < 15  # not the 30 s sleep


def test_the_server_keeps_running_while_its_parent_lives():
    import os

    child = subprocess.Popen([sys.executable, "-c", WATCH.format(folder=str(SERVER.parent), parent=os.getpid())])
    try:
        time.sleep(1.0)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()
