"""Engine-level counters: steps, time in prefill vs decode work, KV usage, prefix-cache hits."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    """Running totals since the engine started.

    Each step's model time is split between prefill and decode work in proportion to the tokens of each kind
    in that step (a decode token is the one new token of a request past its prompt; everything else —
    prompt chunks and recomputation after preemption — is prefill).
    """

    steps: int = 0
    num_fixed_shape_steps: int = 0     # decode-only steps run through a CUDA graph (or its eager twin)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    schedule_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_sampled_tokens: int = 0        # every token sampled so far, its request finished or not (live progress)
    num_preemptions: int = 0
    num_errors: int = 0
    num_forked_samples: int = 0        # samples 1..n-1 of n > 1 requests, started on sample 0's prompt blocks
    num_shared_prompt_tokens: int = 0  # prompt tokens those samples did not compute (shared KV)
    num_draft_tokens: int = 0          # speculative decoding: draft tokens verified
    num_accepted_tokens: int = 0       # of those, accepted
    num_speculative_rows: int = 0      # (request, step) pairs that verified drafts
    num_late_steps: int = 0            # steps whose ids were read one step late (late readback)
    num_late_discarded_tokens: int = 0  # tokens of rows that had ended in the step before (read late: dropped)
    num_images: int = 0                # images in the prompts of finished requests (engine/vision.py)
    num_image_tokens: int = 0          # of their prompt tokens, the image tokens
    num_images_encoded: int = 0        # vision encoder calls (one per image; again after a preemption, never
    # for an image whose tokens a prefix-cache hit covered)
    vision_encoder_s: float = 0.0      # seconds in the vision encoder (inside the steps' model time)
    kv_num_blocks: int = 0
    kv_block_size: int = 0
    kv_blocks_used: int = 0
    kv_peak_blocks_used: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record_step(self, seconds: float, num_prefill: int, num_decode: int) -> None:
        total = num_prefill + num_decode
        self.steps += 1
        if total:
            self.prefill_s += seconds * num_prefill / total
            self.decode_s += seconds * num_decode / total
        self.num_prefill_tokens += num_prefill
        self.num_decode_tokens += num_decode

    def to_dict(self) -> dict:
        out = asdict(self)
        out["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        out["draft_acceptance_rate"] = self.draft_acceptance_rate
        return out
