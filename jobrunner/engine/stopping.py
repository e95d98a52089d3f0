"""When a request is done: stop tokens, EOS, length, and stop strings matched on the decoded text."""

from __future__ import annotations

from jobrunner.engine.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int, tokenizer) -> RequestStatus | None:
    """The finished status after ``token_id`` was appended, or ``None`` to keep going.

    Stop strings are looked for in the text decoded so far (so a match across token boundaries is found);
    on a match the text is cut before the stop string. ``request.text`` is kept current only for requests
    that have stop strings; the rest are decoded once when they finish.
    """
    params = request.params
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids):
        return RequestStatus.FINISHED_STOPPED
    if params.stop and _cut_at_stop_string(request, tokenizer):
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def _cut_at_stop_string(request: Request, tokenizer) -> bool:
    previous_len = len(request.text)
    text = tokenizer.decode(request.output_token_ids, skip_special_tokens=request.params.skip_special_tokens)
    longest = max(len(s) for s in request.params.stop)
    search_from = max(0, previous_len - longest + 1)
    hits = [i for i in (text.find(s, search_from) for s in request.params.stop) if i >= 0]
    request.text = text[:min(hits)] if hits else text
    request.stopped_on_string = bool(hits)
    return bool(hits)


def final_text(request: Request, tokenizer) -> str:
    """The output text of a finished request (already cut at a stop string if one matched)."""
    if request.stopped_on_string:
        return request.text
    return tokenizer.decode(request.output_token_ids, skip_special_tokens=request.params.skip_special_tokens)
