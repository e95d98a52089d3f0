"""When a request is done: stop tokens, EOS, length, and stop strings matched on incrementally decoded text.

Requests with stop strings keep their text current with an incremental detokenizer: each step decodes only a
small window of tokens (from ``prefix_offset``) and appends the new characters, and the stop strings are
looked for only in the new text plus ``longest stop - 1`` characters before it (a match across token
boundaries is still found). Nothing re-decodes the whole output per step. Before ``min_tokens`` tokens no stop
condition but length applies (EOS and stop tokens are also masked in the sampler), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobrunner.engine.request import Request, RequestOutput, RequestStatus


@dataclass
class IncrementalText:
    """Decoding state: tokens before ``prefix_offset`` are final text; ``read_offset`` is where new text starts."""

    prefix_offset: int = 0
    read_offset: int = 0


def check_stop(request: Request, token_id: int, max_model_len: int, tokenizer) -> RequestStatus | None:
    """The finished status after ``token_id`` was appended, or ``None`` to keep going.

    On a stop-string match ``request.text`` is cut before the stop string (after it with
    ``include_stop_str_in_output``).
    """
    params = request.params
    if request.grammar is not None and request.grammar.is_terminated:  # EOS accepted (even with ignore_eos)
        return RequestStatus.FINISHED_STOPPED
    if params.stop:
        new_text = decode_new_text(request, tokenizer)
    if request.num_output_tokens > params.min_tokens or params.min_tokens == 0:
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if params.stop and _cut_at_stop_string(request, len(new_text)):
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def decode_new_text(request: Request, tokenizer) -> str:
    """Append the text of the newest token(s) to ``request.text``; return what was added.

    The window from ``prefix_offset`` gives the decoder context (leading-space rules, multi-byte characters);
    text ending in U+FFFD is an incomplete character, held back until the next token completes it.
    """
    state = request.detok or IncrementalText()
    request.detok = state
    tokens = request.output_token_ids
    skip = request.params.skip_special_tokens
    prefix_text = tokenizer.decode(tokens[state.prefix_offset:state.read_offset], skip_special_tokens=skip)
    window_text = tokenizer.decode(tokens[state.prefix_offset:], skip_special_tokens=skip)
    if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
        return ""
    new_text = window_text[len(prefix_text):]
    state.prefix_offset, state.read_offset = state.read_offset, len(tokens)
    request.text += new_text
    return new_text


def _cut_at_stop_string(request: Request, num_new_chars: int) -> bool:
    if not num_new_chars:
        return False
    params = request.params
    text = request.text
    longest = max(len(s) for s in params.stop)
    search_from = max(0, len(text) - num_new_chars - longest + 1)
    hits = [(i, s) for i, s in ((text.find(s, search_from), s) for s in params.stop) if i >= 0]
    if not hits:
        return False
    index, stop = min(hits)
    request.text = text[:index + len(stop)] if params.include_stop_str_in_output else text[:index]
    request.stopped_on_string = True
    return True


def final_text(request: Request, tokenizer) -> str:
    """The output text of a finished request (already cut at a stop string if one matched)."""
    if request.stopped_on_string:
        return request.text
    return tokenizer.decode(request.output_token_ids, skip_special_tokens=request.params.skip_special_tokens)


def finished_output(request: Request, tokenizer, now: float | None) -> RequestOutput:
    """The output of a finished request: its final text (not for an error), its finish time (``now`` unless set)."""
    if request.status != RequestStatus.FINISHED_ERROR:
        request.text = final_text(request, tokenizer)
    if request.metrics.finish_time is None:
        request.metrics.finish_time = now
    return request.to_output()
