"""vLLM's log (issue 47, symptom 15): kept in the worker's Ray log folder (cleaned up with the worker logs, not
left in the system temp folder), and a vLLM death's cause, the tail of that log, in the error the user sees.
No vLLM needed: a stand-in for vLLM's Python prints a traceback and dies as vLLM would."""

from __future__ import annotations

import os
import stat
import tempfile

import pytest

from jobrunner.driver.actor import worker_log_dir
from jobrunner.vllm_backend.build import vllm_log_path
from jobrunner.vllm_backend.engine import VllmEngine, VllmError, log_tail


def test_the_log_goes_to_the_worker_log_folder_else_the_temp_folder(tmp_path):
    assert vllm_log_path(str(tmp_path)) == str(tmp_path / f"jobrunner-vllm-{os.getpid()}.log")
    assert vllm_log_path(None) == os.path.join(tempfile.gettempdir(), f"jobrunner-vllm-{os.getpid()}.log")


def test_worker_log_dir_is_rays_log_folder_inside_ray_and_none_outside(local_ray):
    import ray

    @ray.remote(num_cpus=0)
    def where() -> str | None:
        return worker_log_dir()

    folder = ray.get(where.remote())
    assert folder is not None and os.path.isdir(folder)
    assert any(name.startswith("worker-") for name in os.listdir(folder))  # beside Ray's worker logs


def _dying_python(tmp_path) -> str:
    """A 'python' that writes a traceback to stderr (vLLM's log) and exits 3, as vLLM dying at start would."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n"
                      "for i in 1 2 3 4 5 6 7 8 9 10; do echo \"INFO loading step $i\" >&2; done\n"
                      "echo 'Traceback (most recent call last):' >&2\n"
                      "echo '  File \"vllm/worker.py\", line 1, in load' >&2\n"
                      "echo 'torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB' >&2\n"
                      "exit 3\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_vllm_death_names_its_cause_from_the_log(tmp_path):
    log = tmp_path / "logs" / "jobrunner-vllm-1.log"
    log.parent.mkdir()
    with pytest.raises(VllmError) as info:
        VllmEngine(_dying_python(tmp_path), {"model": "m"}, None, {}, log_path=str(log), device="cpu")
    message = str(info.value)
    assert message.startswith(f"the vLLM engine process exited (status 3); its log: {log}; it ended with: ")
    assert message.endswith("INFO loading step 6 | INFO loading step 7 | INFO loading step 8 | "
                            "INFO loading step 9 | INFO loading step 10 | Traceback (most recent call last): | "
                            "File \"vllm/worker.py\", line 1, in load | "
                            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_log_tail_of_a_missing_or_empty_log_is_nothing(tmp_path):
    assert log_tail(str(tmp_path / "none.log")) == ""
    (tmp_path / "empty.log").write_text("\n\n")
    assert log_tail(str(tmp_path / "empty.log")) == ""
    (tmp_path / "long.log").write_text("x" * 5000 + "\n")
    assert log_tail(str(tmp_path / "long.log"), max_chars=100) == "; it ended with: " + "x" * 100
