"""SmolLM2-135M (the embedded model: 9 heads, 3 KV heads) through the engine at TP = 3 (three ranks on this
machine: the leader here, two spawned followers, over gloo): every row of a 24-row batch of real chat prompts
gives the tokens of TP = 1; its reported logprobs within 5e-5 (measured 1.2e-5: 30 layers, each rank's partial
sums of o_proj / down_proj added by the all-reduce in another order than one GEMM adds them); each rank's bytes
in ``model_info``."""

from __future__ import annotations

import pytest

from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.llm_engine import LLMEngine
from tests.prompt_sets import gsm8k_prompts

NUM_ROWS, NUM_TOKENS = 24, 16
LOGPROB_TOLERANCE = 5e-5
# chunked prefill (a 24-row batch's prompts over several steps) and room for every row at once
CONFIG = dict(device="cpu", max_num_seqs=NUM_ROWS, max_num_batched_tokens=512, kv_cache_memory_bytes=256 << 20,
              speculative="off")


@pytest.mark.slow
@pytest.mark.heavy
def test_smollm2_tp3_rows_equal_tp1():
    prompts = [[{"role": "user", "content": p}] for p in gsm8k_prompts(NUM_ROWS)]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    single = LLMEngine.from_source("smollm2-135m-instruct", "float32", config=EngineConfig(**CONFIG))
    expected = single.generate(prompts, params)
    single_bytes = single.model_info
    group = LLMEngine.from_source("smollm2-135m-instruct", "float32",
                                  config=EngineConfig(tensor_parallel_size=3, **CONFIG))
    try:
        got = group.generate(prompts, params)
        info = dict(group.model_info)
    finally:
        group.close()
    worst = 0.0
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert b.output_token_ids == a.output_token_ids, f"row {i}"
        worst = max([worst, *(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs))])
    print(f"smollm2 TP=3: {NUM_ROWS} rows equal to TP=1, max |logprob diff| {worst:.2e}; rank 0 weights "
          f"{info['rank_weights_bytes']:,} B, KV {info['rank_kv_bytes']:,} B")
    assert worst <= LOGPROB_TOLERANCE
    assert info["tensor_parallel_size"] == 3
    assert info["rank_weights_bytes"] < single_bytes["memory_weights_bytes"] / 2  # a third plus the norms
