"""The fixed-shape decode path (what CUDA graphs replay): bucket choice and the eager fallback rules."""

import torch
from tiny import engine_from_hf

from jobrunner.attention.decode_graphs import MAX_PADDED_KEYS, DecodeGraphs, DecodeRow, _batch_buckets, _context_buckets
from jobrunner.engine import SamplingParams


def _graphs(max_num_seqs=64, max_model_len=4096, block_size=16) -> DecodeGraphs:
    kv = torch.zeros(1, 2, 8 * block_size, 1, 4)
    return DecodeGraphs(torch.nn.Identity(), kv, block_size, max_num_seqs, max_model_len, scratch_block=7,
                        capture=False)


def _row(position: int, block_size: int = 16) -> DecodeRow:
    blocks = position // block_size + 1
    return DecodeRow(5, position, 0, list(range(blocks)))


def test_buckets_cover_the_limits():
    assert _batch_buckets(64)[-1] == 64 and _batch_buckets(6) == (1, 2, 4, 6)
    ctx = _context_buckets(256)
    assert ctx[0] == 16 and ctx[-1] == 256 and list(ctx) == sorted(set(ctx))
    assert _context_buckets(3) == (3,)


def test_shape_pads_rows_and_context():
    g = _graphs()
    assert g.shape_for([_row(10)] * 3) == (4, 16)           # 3 rows -> 4; 1 block -> the 16-block bucket
    assert g.shape_for([_row(300)] * 20) == (24, 24)       # 19 blocks -> the next bucket (16 * 1.5)
    assert g.shape_for([]) is None
    assert g.shape_for([_row(10)] * 65) is None            # more rows than the largest bucket


def test_too_much_padding_runs_eagerly():
    g = _graphs(max_num_seqs=256, max_model_len=8192)
    # one long row among many short ones: padding every row to the long one would waste > 2x the keys
    assert g.shape_for([_row(4000)] + [_row(20)] * 63) is None
    assert g.shape_for([_row(4000)] * 64) is not None
    assert 256 * 8192 > MAX_PADDED_KEYS and g.shape_for([_row(8000)] * 256) is None


def test_static_decode_counts_fixed_shape_steps(hf_llama, tokenizer):
    engine = engine_from_hf(hf_llama, tokenizer, static_decode=True, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.generate(["one two three", "four five"], params)
    stats = engine.stats().to_dict()
    # every step after the joint prefill is a decode-only step of 2 rows padded to the 2-row bucket
    assert stats["num_fixed_shape_steps"] == 5 and stats["steps"] == 6
    assert engine.runner.kv_cache.shape[2] == (engine.kv_manager.pool.num_blocks + 1) * engine.config.block_size


def test_step_graph_token_buckets_end_at_the_step_budget():
    from jobrunner.attention.step_graphs import _token_buckets

    assert _token_buckets(2048)[-1] == 2048 and _token_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert _token_buckets(1) == (1,)
