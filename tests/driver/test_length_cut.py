"""validate's prompt-length count stops near the context (issue 47: a 20 MB prompt was tokenized whole): a text
far over the context is counted on a cut of it, and the "too long" verdict stays right."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from jobrunner.driver import length_check
from jobrunner.driver.length_check import count_prompt_tokens


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_hf_dir: Path):
    from jobrunner.models.weights import load_tokenizer

    return load_tokenizer(tiny_llama_hf_dir)


def _exact(tokenizer, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def test_a_huge_prompt_is_counted_only_past_the_context(tokenizer) -> None:
    huge = "word " * 400_000  # 2 MB of text
    started = time.perf_counter()
    num = count_prompt_tokens(tokenizer, huge, context=64)
    assert time.perf_counter() - started < 5
    cut = (64 + length_check.CUT_MARGIN) * length_check.CHARS_PER_TOKEN_BOUND
    assert num == _exact(tokenizer, huge[:cut]) and num >= 64 + length_check.CUT_MARGIN
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": huge}]
    assert count_prompt_tokens(tokenizer, chat, context=64) >= 64 + length_check.CUT_MARGIN


def test_below_the_cut_the_count_is_exact(tokenizer) -> None:
    text = "hello world " * 20
    assert count_prompt_tokens(tokenizer, text, context=64) == _exact(tokenizer, text)
    assert count_prompt_tokens(tokenizer, [1, 2, 3], context=2) == 3  # token ids as given


def test_a_cut_with_too_few_tokens_counts_the_whole_text(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(length_check, "CHARS_PER_TOKEN_BOUND", 1)  # a cut of 128 characters
    text = "the " * 100  # ~4 characters per token: the cut's tokens do not reach 64 + 64
    assert _exact(tokenizer, text[:128]) < 128 and _exact(tokenizer, text) > 64
    assert count_prompt_tokens(tokenizer, text, context=64) == _exact(tokenizer, text)
