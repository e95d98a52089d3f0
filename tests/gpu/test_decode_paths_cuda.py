"""The opt-in decode paths on CUDA: split-K decode attention (bf16, head_dim 128) against the torch backend, and
one-step-late readback through CUDA graphs against the synchronous path. Needs a GPU.

Marked ``slow``: they stay out of the core GPU check's test stage (opt-in paths must not decide its verdict);
the check's extra phase measures and compares both on the 8B shape (``scripts/gpu_decode_ab.py``)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (8, 8)])
def test_split_decode_bf16_head_dim_128_matches_torch(num_heads, num_kv_heads) -> None:
    from test_split_decode import _attend, _decode_layout

    from jobrunner.attention import make_backend
    from jobrunner.attention.torch_backend import TORCH_BACKEND

    torch.manual_seed(0)
    lengths = [1, 70, 511, 512, 513, 1500, 4000]        # one segment or less, boundaries, long rows
    num_blocks, block_size = 520, 16
    layout, slots = _decode_layout(lengths, block_size, num_blocks, random.Random(1))
    dev, dt, head_dim = torch.device("cuda"), torch.bfloat16, 128
    cache = torch.randn(2, num_blocks * block_size, num_kv_heads, head_dim, device=dev, dtype=dt)
    q = torch.randn(layout.num_tokens, num_heads, head_dim, device=dev, dtype=dt)
    k = torch.randn(layout.num_tokens, num_kv_heads, head_dim, device=dev, dtype=dt)
    v = torch.randn(layout.num_tokens, num_kv_heads, head_dim, device=dev, dtype=dt)
    split = make_backend("triton", num_heads, num_kv_heads, block_size, dev, split_decode="on")
    got, meta = _attend(split, layout, slots, q, k, v, cache)
    assert meta.num_segments == 8                         # 4000 keys / 512
    want, _ = _attend(TORCH_BACKEND, layout, slots, q.float(), k.float(), v.float(), cache.float())
    torch.testing.assert_close(got.float(), want, atol=4e-2, rtol=2e-2)
    assert (got.float() - want).abs().mean() < 2e-3


@pytest.mark.parametrize("backend,split", [("torch", "off"), ("triton", "off"), ("triton", "on")])
def test_late_readback_through_cuda_graphs_matches_synchronous_steps(backend, split) -> None:
    """float32, tiny model: late readback (ids left on the device, read while the next step runs) gives the
    synchronous path's tokens, stops seen late included; steps really ran late and through graphs."""
    from test_gpu_engine import _engine, _tiny

    from jobrunner.engine import SamplingParams

    tokenizer, hf, prompts = _tiny()
    settings = dict(block_size=4, max_num_batched_tokens=48, max_num_seqs=4, attention_backend=backend,
                    use_cuda_graphs=True, speculative="off", split_decode=split)
    free = _engine(hf, tokenizer, torch.float32, **settings).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, seed=i,
                             stop_token_ids=[o.output_token_ids[2 + i % 5]]) for i, o in enumerate(free)]
    want = [o.output_token_ids for o in _engine(hf, tokenizer, torch.float32, **settings).generate(prompts, params)]
    engine = _engine(hf, tokenizer, torch.float32, late_readback="cuda", **settings)
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.stats()
    assert stats.num_late_steps > 0 and stats.num_fixed_shape_steps > 0 and stats.num_late_discarded_tokens > 0
    assert engine.runner.stats()["attention_fallbacks"] == 0
    engine.check_integrity()
