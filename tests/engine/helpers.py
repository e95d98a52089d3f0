"""Test helpers: run an engine step by step with the integrity check after every step."""

from __future__ import annotations

from jobrunner.engine import SamplingParams
from jobrunner.engine.llm_engine import LLMEngine


def run_checked(engine: LLMEngine, prompts, params: SamplingParams | list[SamplingParams],
                by_sample: bool = False) -> dict:
    """Add prompts as requests "r0", "r1", ...; step to completion checking the KV pool every step.

    Outputs are keyed by request id, or with ``by_sample`` by ``(request_id, sample_index)`` (requests with
    ``n > 1``); each key must come back once.
    """
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.sample_index) if by_sample else out.request_id
            assert key not in outputs, f"{key} finished twice"
            outputs[key] = out
        engine.check_integrity()
    assert engine.kv_manager.pool.num_used_blocks == 0
    return outputs


def hf_greedy(hf_model, token_ids: list[int], max_new_tokens: int) -> list[int]:
    import torch

    ids = torch.tensor([token_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()
