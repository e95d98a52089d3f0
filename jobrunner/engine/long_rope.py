"""longrope (Phi-3 / Phi-3.5): when a sequence moves from the short to the long rope table, as transformers does.

transformers 5.24 rotates every position of a forward pass with longrope's short factors while the sequence is at
most ``original_max_position_embeddings`` (the *threshold*) long, and with its long factors past that
(``dynamic_rope_update``: ``max(position_ids) + 1 > threshold``); ``Phi3ForCausalLM.prepare_inputs_for_generation``
drops the KV cache at the token that first takes the sequence past the threshold, so the whole sequence is then
recomputed on the long factors, and stays on them. A cached key is therefore always rotated with the table the
sequence's current length picks, and the logits at length ``L`` are those of one uncached forward over ``L``
tokens.

We do the same, per request (rows of one step may use different tables: each row's positions are looked up in
its own table, ``RotaryEmbedding.table_offset``):
- a request whose ``num_tokens`` (prompt + output so far) exceeds the threshold runs on the long table
  (``Request.rope_table = 1``) for every position, from its first prefill chunk on; otherwise on the short one;
- a running request whose last sampled token took it past the threshold is recomputed: its blocks are freed and
  it goes back to the front of the waiting queue with nothing computed (the preemption path, not counted as a
  preemption), to be prefilled again on the long table (prefix-cache hits included);
- prefix-cache blocks are keyed by their table too (``KVCacheManager``), so short and long blocks never mix;
- a short-table request's speculative drafts are capped so no scored position's sequence passes the threshold.

The switch exists only when the engine's ``max_model_len`` exceeds the threshold; otherwise every sequence stays
on the short table, which is what transformers does at every length such an engine can reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from jobrunner.engine.request import Request

SHORT_TABLE, LONG_TABLE = 0, 1


@dataclass(frozen=True)
class LongRopeSwitch:
    """The rule above for one model; ``threshold`` is its ``original_max_position_embeddings``."""

    threshold: int

    def table_for(self, request: Request) -> int:
        """The table the request's KV must be rotated with now."""
        return LONG_TABLE if request.num_tokens > self.threshold else SHORT_TABLE

    def must_recompute(self, request: Request) -> bool:
        """Whether the request's computed KV is on a table its length no longer picks (short -> long only)."""
        return request.num_computed_tokens > 0 and request.rope_table != self.table_for(request)

    def max_draft(self, request: Request) -> int | None:
        """How many speculative tokens the request may score this step (None: no limit from rope)."""
        if request.rope_table == LONG_TABLE:
            return None
        # the logits at draft position num_tokens + j come from a sequence of num_tokens + j + 1 tokens
        return max(0, self.threshold - request.num_tokens)

    def assign(self, request: Request) -> None:
        """Put a request that holds no KV of its own on its table (forgetting block hashes of the other one)."""
        table = self.table_for(request)
        if table != request.rope_table:
            request.rope_table = table
            request.block_hashes = []


def make_long_rope_switch(model, max_model_len: int) -> LongRopeSwitch | None:
    """The model's switch, or None when it has no long table or no sequence of this engine can pass it."""
    rotary = getattr(model, "rotary", None)
    threshold = getattr(rotary, "long_threshold", None)
    if threshold is None or max_model_len <= threshold:
        return None
    return LongRopeSwitch(threshold)
