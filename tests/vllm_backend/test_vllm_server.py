"""The vLLM server process ends with its worker: `watch_parent` exits the process once its parent is gone (a
step hung inside vLLM never reads its closed pipe). Needs no vLLM: the server imports it only to start."""

from __future__ import annotations

import subprocess
import sys

from jobrunner.vllm_backend.engine import SERVER

# After the watch starts, the script outlives any test's patience and then exits with its own code (7): an exit
# code 0 can only come from the watch (os._exit(0)), so no clock is read to tell the two apart.
WATCH = ("import sys, time; sys.path.insert(0, {folder!r}); import server; "
         "server.watch_parent({parent}, interval_s=0.05); time.sleep({sleep_s}); sys.exit(7)")


def test_the_server_exits_once_its_parent_is_gone():
    orphan = subprocess.run([sys.executable, "-c", WATCH.format(folder=str(SERVER.parent), parent=1, sleep_s=600)],
                            timeout=300, check=False)  # the timeout only guards a broken watch
    assert orphan.returncode == 0  # the watch ended it, not the end of its sleep (7)


def test_the_server_keeps_running_while_its_parent_lives():
    import os

    # 20 checks of a live parent (1 s at 0.05 s), then the script's own exit: the watch never ended it
    alive = subprocess.run([sys.executable, "-c", WATCH.format(folder=str(SERVER.parent), parent=os.getpid(),
                                                              sleep_s=1.0)], timeout=300, check=False)
    assert alive.returncode == 7
