"""Grammar masks kept on the device: the masked logits equal a fresh per-step bitmask's, and only rows whose
grammar moved are refilled."""

import random

import pytest
import torch

from jobrunner.engine import SamplingParams
from jobrunner.engine.request import Request
from jobrunner.engine.sampling.grammar_masks import DeviceGrammarMasks
from tests.components import require_import

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture
def compiler(tokenizer):
    require_import("xgrammar", "the [structured] extra: structured output's grammar matcher")
    from jobrunner.engine.sampling.structured import GrammarCompiler

    return GrammarCompiler(tokenizer, len(tokenizer) + 5, [tokenizer.eos_token_id])   # a padded model vocab


def _requests(compiler, specs):
    out = []
    for i, params in enumerate(specs):
        r = Request(f"r{i}", [1, 2], params, 0.0, sample_index=i % 2)
        r.grammar = compiler.factory(params)() if params.is_structured else None
        out.append(r)
    return out


def _fresh_reference(compiler, logits, rows, requests):
    """What a step gave before: a new bitmask filled for every constrained row, applied to those rows."""
    xgr = require_import("xgrammar", "structured output")
    bitmask = xgr.allocate_token_bitmask(len(rows), compiler.vocab_size)
    for i, row in enumerate(rows):
        requests[row].grammar.fill(bitmask, i)
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=compiler.vocab_size)
    out = logits.clone()
    out[rows] = sub
    return out


def test_device_masks_match_a_fresh_bitmask_and_refill_only_moved_rows(compiler):
    specs = [SamplingParams(json_schema=SCHEMA), SamplingParams(), SamplingParams(regex="[ab]{2,6}"),
             SamplingParams(choice=["fox", "dog"]), SamplingParams(json_schema=SCHEMA)]
    requests = _requests(compiler, specs)
    masks = DeviceGrammarMasks(torch.device("cpu"))
    rng = random.Random(0)
    torch.manual_seed(0)
    fills = []
    for step in range(8):
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and not r.grammar.is_terminated]
        if not rows:
            break
        logits = torch.randn(len(requests), compiler.vocab_size)
        want = _fresh_reference(compiler, logits, rows, requests)
        got = logits.clone()
        masks.apply(got, rows, [requests[i] for i in rows])
        assert torch.equal(got, want), step
        fills.append(masks.num_fills)
        advancing = rows if step % 3 != 1 else rows[:1]     # every third step only one row moves
        for i in advancing:
            allowed = torch.isfinite(got[i]).nonzero().flatten().tolist()
            assert requests[i].grammar.accept(rng.choice(allowed))
    # 4 rows filled first; a step after all rows moved refills all; after one row moved, only that one
    assert fills[:3] == [4, 8, 9]
    assert masks.num_fills < 4 * len(fills)


def test_reused_key_and_released_rows_are_filled_afresh(compiler):
    masks = DeviceGrammarMasks(torch.device("cpu"))
    first = _requests(compiler, [SamplingParams(choice=["fox"])])
    masks.apply(torch.zeros(1, compiler.vocab_size), [0], first)
    again = _requests(compiler, [SamplingParams(choice=["dog"])])   # same key, another grammar
    logits = torch.zeros(1, compiler.vocab_size)
    masks.apply(logits, [0], again)
    assert masks.num_fills == 2 and torch.equal(logits, _fresh_reference(compiler, torch.zeros_like(logits), [0],
                                                                         again))
    masks.release(again[0].key)
    assert masks.rows == {} and len(masks.free) == masks.capacity
