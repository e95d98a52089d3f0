"""Real prompts for the real-model tests, from the sets committed under ``tests/data/`` (with their licences):
the suite reads nothing outside the checkout."""

from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
GSM8K = DATA_DIR / "gsm8k_test.prompts.jsonl"  # MIT, tests/data/gsm8k_test.LICENSE


def gsm8k_prompts(num: int) -> list[str]:
    """The first ``num`` GSM8K test questions, in their original order."""
    with GSM8K.open(encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for _, line in zip(range(num), f)]
    if len(prompts) != num:
        raise ValueError(f"{GSM8K} holds {len(prompts)} prompts, fewer than the {num} asked for")
    return prompts
