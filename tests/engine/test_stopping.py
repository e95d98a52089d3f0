"""Incremental detokenization and stop strings checked on new text only."""

import random

from tiny import CORPUS

from jobrunner.engine import SamplingParams
from jobrunner.engine.request import Request, RequestStatus
from jobrunner.engine.stopping import check_stop, decode_new_text


def test_incremental_text_equals_a_full_decode(tokenizer):
    rng = random.Random(0)
    texts = CORPUS[:5] + ["naïve café — 東京 🎉 ok", "\u00e9\u0301 ß ﬁ"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert incremental(tokenizer, ids) == tokenizer.decode(ids) == text
        ids += [rng.randrange(5, len(tokenizer)) for _ in range(30)]  # random bytes: broken UTF-8 too
        full = tokenizer.decode(ids, skip_special_tokens=True)
        got = incremental(tokenizer, ids)
        assert full.startswith(got) and len(full) - len(got) <= 3  # at most an incomplete character held back


def incremental(tokenizer, ids: list[int]) -> str:
    request = Request("r", [1], SamplingParams(stop=["\x00never"]), 0.0)
    for token in ids:
        request.output_token_ids.append(token)
        decode_new_text(request, tokenizer)
    return request.text


def test_stop_string_across_tokens_is_found_and_cut(tokenizer):
    ids = tokenizer("The quick brown fox jumps", add_special_tokens=False)["input_ids"]
    request = Request("r", [1], SamplingParams(max_tokens=50, stop=["own fo"]), 0.0)
    for token in ids:
        request.output_token_ids.append(token)
        status = check_stop(request, token, 512, tokenizer)
        if status is not None:
            break
    assert status is RequestStatus.FINISHED_STOPPED
    assert request.text == "The quick br" and request.stopped_on_string
    # stopped on the first token whose text completes the stop string
    assert "own fo" in tokenizer.decode(request.output_token_ids)
    assert "own fo" not in tokenizer.decode(request.output_token_ids[:-1])
