"""A fake judge for pipeline tests: the project's fake engine, answering JSON built from the prompt.

A prompt holding "question N" is answered `{"score": N % 10}` (a known score per row); one holding
"UNPARSEABLE" is answered with prose (no JSON: json_valid false). Everything else about the engine (steps,
delays, metrics, `hold_file`) is the fake engine's (tests/driver/fake_engine.py).
"""

from __future__ import annotations

import json
import re

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
