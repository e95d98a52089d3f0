"""OUR engine (``LLMEngine`` on the job's model, built as a worker builds it) behind the worker, with the two
faults the driver's fault tests inject into the fake engine, for `engine.factory:
tests.driver.real_engine:make_engine`:

- ``fail_on``: a step while a request whose prompt holds this text is unfinished raises (the row crashes the
  engine, as a kernel fault on one input would); the worker isolates the row and rebuilds our engine;
- ``hold_file``: after ``hold_after`` finished requests, steps wait (at most 120 s) until the file exists, so a
  test sees the job mid-run however fast the machine is.

Everything else is the real engine: its scheduler, KV cache, model, sampler and its own ``rebuild()``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from jobrunner.driver.engine_factory import build_engine


class FaultyEngine:
    """A real engine plus the injected faults; every other member is the engine's own."""

    def __init__(self, engine: Any, fail_on: str | None, hold_file: str | None, hold_after: int) -> None:
        self._engine, self._fail_on, self._hold_file, self._hold_after = engine, fail_on, hold_file, hold_after
        self._poisoned: set[str] = set()
        self._num_finished = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, request_id: str, prompt: Any, params: Any = None, **kwargs: Any) -> None:
        self._engine.add_request(request_id, prompt, params, **kwargs)
        if self._fail_on and self._fail_on in self._text(prompt):
            self._poisoned.add(request_id)

    def step(self) -> list[Any]:
        if self._poisoned:
            raise RuntimeError(f"injected engine crash ({self._fail_on!r} in the step)")
        if self._hold_file and self._num_finished >= self._hold_after:
            deadline = time.monotonic() + 120.0
            while not os.path.exists(self._hold_file) and time.monotonic() < deadline:
                time.sleep(0.05)
        outputs = self._engine.step()
        self._num_finished += sum(1 for o in outputs if getattr(o, "finished", True))
        return outputs

    def rebuild(self) -> FaultyEngine:
        return FaultyEngine(self._engine.rebuild(), self._fail_on, self._hold_file, self._hold_after)

    def _text(self, prompt: Any) -> str:
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], int):
            return self._engine.tokenizer.decode(prompt)
        return " ".join(str(m.get("content") or "") for m in prompt or [])


def make_engine(spec: Any, fail_on: str | None = None, hold_file: str | None = None,
                hold_after: int = 1) -> FaultyEngine:
    """The engine a worker builds for ``spec`` without a factory (ours, on ``model.source``), with the faults."""
    engine = spec.engine.model_copy(update={"factory": None, "factory_options": {}})
    return FaultyEngine(build_engine(spec.model_copy(update={"engine": engine})), fail_on, hold_file, hold_after)
