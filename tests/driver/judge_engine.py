"""A fake judge for pipeline tests: the project's fake engine, answering JSON built from the prompt.

A prompt holding "question N" is answered `{"score": N % 10}` (a known score per row); one holding
"UNPARSEABLE" is answered with prose (no JSON: json_valid false). Everything else about the engine (steps,
delays, metrics, `hold_file`) is the fake engine's (tests/driver/fake_engine.py). `make_gated` is a generator
that pauses after `hold_after` finished rows until `gate_file` exists: a test sees the next stage work while
this one still has shards to do, however slowly the machine runs.
"""

from __future__ import annotations

import json
import os
import re
import time

from tests.driver.fake_engine import FakeEngine, make_engine


class JudgeEngine(FakeEngine):
    """FakeEngine whose finished texts are the judge's answers."""

    def _finish(self, req, now):  # noqa: ANN001, ANN202 - FakeEngine's private hook
        out = super()._finish(req, now)
        if out.error is None:
            out.text = judge_answer(req.text)
        return out

    def rebuild(self) -> JudgeEngine:
        engine = JudgeEngine(self.max_num_seqs, self.max_model_len, self.step_delay_s, hold_file=self.hold_file)
        return engine


def judge_answer(prompt: str) -> str:
    """The answer the judge gives to `prompt`."""
    if "UNPARSEABLE" in prompt:
        return "I would rather not say."
    found = re.search(r"question (\d+)", prompt)
    score = int(found.group(1)) % 10 if found else 0
    return f"Verdict: {json.dumps({'score': score})}"


def make_judge(spec, **options) -> JudgeEngine:  # noqa: ANN001
    """`engine.factory: tests.driver.judge_engine:make_judge` (options as make_engine's)."""
    base = make_engine(spec, **options)
    engine = JudgeEngine(base.max_num_seqs, base.max_model_len, base.step_delay_s, hold_file=base.hold_file)
    return engine


class GatedEngine(FakeEngine):
    """FakeEngine whose steps wait (at most 120 s) once `hold_after` rows finished, until `gate_file` exists."""

    def __init__(self, *args, gate_file: str = "", hold_after: int = 0, **kwargs) -> None:  # noqa: ANN002, ANN003
        super().__init__(*args, **kwargs)
        self.gate_file, self.hold_after = gate_file, hold_after

    def step(self):  # noqa: ANN201 - FakeEngine's
        deadline = time.monotonic() + 120.0
        while self._num_finished >= self.hold_after and not os.path.exists(self.gate_file) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        return super().step()

    def rebuild(self) -> GatedEngine:
        return GatedEngine(self.max_num_seqs, self.max_model_len, self.step_delay_s, gate_file=self.gate_file,
                           hold_after=self.hold_after)


def make_gated(spec, gate_file: str, hold_after: int, step_delay_s: float = 0.0) -> GatedEngine:  # noqa: ANN001
    """`engine.factory: tests.driver.judge_engine:make_gated` (factory_options gate_file, hold_after)."""
    return GatedEngine(spec.engine.max_num_seqs, spec.engine.max_model_len or 512, step_delay_s,
                       gate_file=gate_file, hold_after=hold_after)
