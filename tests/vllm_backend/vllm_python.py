"""Where the suite finds vLLM: $JOBRUNNER_VLLM_PYTHON, else `make vllm`'s .venv-vllm. A promised component:
missing, its tests skip on a developer's machine and fail under CI=true (tests/components.py)."""

from __future__ import annotations

import os

from jobrunner.vllm_backend.mapping import VLLM_PYTHON_ENV, vllm_problem
from tests.components import REPO_ROOT, missing_component


def vllm_python_or_skip() -> str:
    python = os.environ.get(VLLM_PYTHON_ENV) or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    problem = vllm_problem(python)
    if problem:
        missing_component(f"{problem} (`make vllm` makes .venv-vllm)")
    return python
