"""The cpu_paged attention kernel against the torch backend (the reference) on random tensors, per forced capability.

Mixed steps: prompt chunks from 0, chunks after a cached prefix, long and short decodes, a tail chunk; block
boundaries (blocks of 16, 32 and 7), GQA ratios 1, 3, 4, 8, head dims 64 and 128, sliding-window edges,
float32 and bfloat16, in three modes: every row on the exact kernel (deterministic mode), chunks on the fast
prompt-chunk kernel (the default of AVX-512 and AVX2 builds), chunks of more than 8 tokens on the torch groups
(the default of the portable build). Batch invariance: a row's output bits do not
depend on the other rows, on the thread count (split-K or not), nor on whether its token was a decode or part
of a chunk. A failed build fails these tests under CI=true (tests/components.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from jobrunner.attention import StepLayout, StepUpload, cpu_paged, make_backend
from jobrunner.attention.cpu_paged import NATIVE_ENV, SOURCE, _library, native_library
from jobrunner.attention.torch_backend import TORCH_BACKEND
from jobrunner.kernels import CAPABILITY_ENV, build_library
from tests.components import native_build_failed, require_library

CPU = torch.device("cpu")
HAS_AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
HAS_AVX2 = " avx2" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
# chunk from 0 | chunk after a cached prefix | decodes (long, first token, short) | 2-token tail | long chunk
# after a long prefix (several partitions of 512 keys) | a long decode
MIXED = [(0, 21), (37, 6), (70, 1), (0, 1), (12, 1), (33, 2), (1030, 40), (1500, 1)]


@pytest.fixture(params=["native", "avx512", "avx2", "default"])
def capability(request, monkeypatch):
    """The kernel built for this CPU (-march=native), for forced AVX-512 (-march=skylake-avx512), forced AVX2
    (-march=haswell) and the portable x86-64 build."""
    if request.param != "native":
        if request.param == "avx512" and not HAS_AVX512:
            pytest.skip("this CPU has no AVX-512 (avx512f): the avx512 build is only compiled here "
                        "(test_avx512_build_compiles)")
        if request.param == "avx2" and not HAS_AVX2:
            pytest.skip("this CPU has no AVX2: the forced avx2 build cannot run here")
        monkeypatch.setenv(CAPABILITY_ENV, request.param)
    require_library(native_library())  # this CPU runs every build asked for here: a failed one fails
    return request.param


def _layout(rows, block_size, rng, window=None, prefix_blocks=0, shared=()):
    """rows: (start, query_len) -> a StepLayout with shuffled block tables, its slot list and the pool size.
    The tables of the rows in ``shared`` start with the same ``prefix_blocks`` blocks (a cached header)."""
    num_blocks = prefix_blocks + sum(-(-(s + q) // block_size) for s, q in rows) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(prefix_blocks)]
    layout = StepLayout([], [], [], [], 0, block_size, sliding_window=window)
    slots = []
    for i, (start, q_len) in enumerate(rows):
        seq_len = start + q_len
        need = -(-seq_len // block_size)
        head = prefix if i in shared else []
        table = head + [free.pop() for _ in range(need - len(head))]
        layout.query_starts.append(layout.num_tokens)
        layout.query_lens.append(q_len)
        layout.seq_lens.append(seq_len)
        layout.block_tables.append(table)
        layout.num_tokens += q_len
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, seq_len)]
    return layout, slots, num_blocks


def _attend(backend, layout, slots, q, k, v, cache):
    upload = StepUpload(CPU)
    upload.add("slot_mapping", slots)
    meta = backend.build(layout, upload)
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    return backend.forward(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5), k_cache, v_cache


def _inputs(layout, num_slots, num_heads, num_kv_heads, head_dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_slots, num_kv_heads, head_dim, generator=gen).to(dtype)  # prefixes "cached"
    q, k, v = (torch.randn(layout.num_tokens, h, head_dim, generator=gen).to(dtype)
               for h in (num_heads, num_kv_heads, num_kv_heads))
    return q, k, v, cache


def _backend(num_heads, num_kv_heads, block_size, head_dim, all_native):
    """all_native True: every row on the exact kernel; "fast": chunks on the fast kernel; False: long chunks on
    the torch groups (what narrow builds do by default); "fast-sdpa": chunks of more than 16 tokens on the torch
    groups, shorter ones on the fast kernel (what bf16 on AMX does with 64)."""
    backend = make_backend("cpu_paged", num_heads, num_kv_heads, block_size, CPU, head_dim=head_dim)
    backend.native_max_query = {True: None, "fast": None, "fast-sdpa": 16}.get(all_native, cpu_paged.NATIVE_MAX_QUERY)
    backend.fast_min_query = cpu_paged.FAST_MIN_QUERY if all_native in ("fast", "fast-sdpa") else 0
    return backend


MODES = pytest.mark.parametrize("all_native", [True, "fast", False, "fast-sdpa"],
                                ids=["all-exact", "fast-chunks", "long-chunks-sdpa", "fast-and-sdpa"])


@MODES
@pytest.mark.parametrize("block_size", [16, 32, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 64)])
def test_matches_torch_on_mixed_steps(capability, all_native, block_size, num_heads, num_kv_heads, head_dim):
    layout, slots, num_blocks = _layout(MIXED, block_size, random.Random(block_size + num_heads))
    q, k, v, cache = _inputs(layout, num_blocks * block_size, num_heads, num_kv_heads, head_dim, num_heads)
    backend = _backend(num_heads, num_kv_heads, block_size, head_dim, all_native)
    got, got_k, got_v = _attend(backend, layout, slots, q, k, v, cache)
    want, want_k, want_v = _attend(TORCH_BACKEND, layout, slots, q, k, v, cache)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # the step's K/V written at its slots
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("all_native", [True, "fast"], ids=["all-exact", "fast-chunks"])
@pytest.mark.parametrize("window", [1, 15, 16, 17, 512, 600])
def test_sliding_window_edges_match_torch(capability, window, all_native):
    layout, slots, num_blocks = _layout(MIXED, 16, random.Random(window), window)
    q, k, v, cache = _inputs(layout, num_blocks * 16, 8, 2, 64, window)
    got, _, _ = _attend(_backend(8, 2, 16, 64, all_native), layout, slots, q, k, v, cache)
    want, _, _ = _attend(TORCH_BACKEND, layout, slots, q, k, v, cache)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@MODES
def test_bfloat16_matches_torch(capability, all_native):
    layout, slots, num_blocks = _layout(MIXED, 16, random.Random(2))
    q, k, v, cache = _inputs(layout, num_blocks * 16, 9, 3, 64, 2, torch.bfloat16)
    got, got_k, _ = _attend(_backend(9, 3, 16, 64, all_native), layout, slots, q, k, v, cache)
    want, want_k, _ = _attend(TORCH_BACKEND, layout, slots, q, k, v, cache)
    exact, _, _ = _attend(TORCH_BACKEND, layout, slots, q.float(), k.float(), v.float(), cache.float())
    assert got.dtype == torch.bfloat16 and torch.equal(got_k, want_k)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    # float32 accumulation, one rounding at the end: within half a bf16 step of the float32 result
    torch.testing.assert_close(got.float(), exact.to(torch.bfloat16).float(), atol=8e-3, rtol=8e-3)


def _one_row_bits(rows, index, threads, block_size=16, seed=7):
    """Row ``index``'s output (bits) in a step of ``rows``, all native, with ``threads`` threads."""
    layout, slots, num_blocks = _layout(rows, block_size, random.Random(seed))
    q, k, v, cache = _inputs(layout, num_blocks * block_size, 8, 1, 64, seed)
    start, q_len = layout.query_starts[index], layout.query_lens[index]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, _, _ = _attend(_backend(8, 1, block_size, 64, True), layout, slots, q, k, v, cache)
    finally:
        torch.set_num_threads(before)
    return out[start:start + q_len], q[start:start + q_len], cache


def test_row_bits_do_not_depend_on_threads_or_split_k(capability):
    # one long decode and one kv head: with 2 threads the row is split over its 4 partitions (split-K)
    alone_1, _, _ = _one_row_bits([(1800, 1)], 0, 1)
    alone_2, _, _ = _one_row_bits([(1800, 1)], 0, 2)
    assert torch.equal(alone_1, alone_2)


def test_decode_bits_equal_the_same_token_in_a_chunk(capability):
    """The last token of a 700-token chunk (after a 600-token prefix), and the same token as a decode after it."""
    rng = random.Random(3)
    layout, slots, num_blocks = _layout([(600, 700)], 16, rng)
    q, k, v, cache = _inputs(layout, num_blocks * 16, 8, 2, 64, 3)
    backend = _backend(8, 2, 16, 64, True)
    chunk, k_cache, v_cache = _attend(backend, layout, slots, q, k, v, cache)
    decode = StepLayout([0], [1], [1300], layout.block_tables, 1, 16)
    with_neighbours = StepLayout([0, 1, 4], [1, 3, 1], [1300, 20, 90], layout.block_tables * 3, 5, 16)
    filled = torch.stack([k_cache, v_cache])
    for step in (decode, with_neighbours):
        rows = q[-1:].expand(step.num_tokens, -1, -1).contiguous()
        kv = (k[-1:].expand(step.num_tokens, -1, -1).contiguous(), v[-1:].expand(step.num_tokens, -1, -1).contiguous())
        got, _, _ = _attend(backend, step, [slots[-1]] * step.num_tokens, rows, *kv, filled)
        assert torch.equal(got[0], chunk[-1])


def test_defaults_follow_the_builds_vector_width(capability):
    """AVX-512 (16 lanes) and AVX2 (8 lanes) builds send every chunk to the fast kernel and group the decodes
    sharing a prefix; the portable build (4 lanes) sends long chunks to SDPA and shares nothing."""
    backend = make_backend("cpu_paged", 8, 2, 16, CPU, head_dim=64)
    expected_lanes = {"avx512": 16, "avx2": 8, "default": 4}.get(capability, 16 if HAS_AVX512 else 8)
    assert backend.lanes == expected_lanes
    if expected_lanes >= cpu_paged.FAST_MIN_LANES:
        assert (backend.fast_min_query, backend.native_max_query) == (cpu_paged.FAST_MIN_QUERY, None)
    else:
        assert (backend.fast_min_query, backend.native_max_query) == (0, cpu_paged.NATIVE_MAX_QUERY)


@pytest.mark.parametrize("forced,setting,dtype,expected", [
    ("amx", "", torch.bfloat16, cpu_paged.BF16_SDPA_MIN_QUERY), ("amx", "", torch.float32, None),
    ("amx", "0", torch.bfloat16, None), ("avx512_bf16", "", torch.bfloat16, None),
    ("avx512_bf16", "1", torch.bfloat16, cpu_paged.BF16_SDPA_MIN_QUERY)])
def test_bf16_prompt_chunks_go_to_sdpa_on_amx(monkeypatch, forced, setting, dtype, expected):
    """bf16 on AMX: chunks of more than 64 tokens on torch's SDPA (its bf16 flash attention), shorter ones and the
    shared-prefix decodes on the fast kernel; the rule is the capability's (a forced avx512_bf16 build runs on an
    AVX-512 CPU only). With the AMX kernel off: where it runs it takes these chunks first (test_amx_attention)."""
    if not HAS_AVX512:
        pytest.skip("the forced AVX-512 builds run on an AVX-512 CPU only")
    monkeypatch.setenv(CAPABILITY_ENV, forced)
    monkeypatch.setenv("JOBRUNNER_ATTENTION_AMX", "0")
    monkeypatch.setenv(cpu_paged.BF16_SDPA_ENV, setting)
    backend = make_backend("cpu_paged", 9, 3, 16, CPU, head_dim=64, dtype=dtype)
    assert backend.native_max_query == expected and backend.fast_min_query == cpu_paged.FAST_MIN_QUERY
    assert ("torch's SDPA" in backend.chunk_route) == (expected is not None)


def test_avx512_build_compiles(monkeypatch):
    """The AVX-512 build compiles on any machine with a compiler; it runs (the ``avx512`` parity cases) only on
    a CPU with AVX-512."""
    monkeypatch.setenv(CAPABILITY_ENV, "avx512")
    try:
        path = build_library("paged_attention", source=SOURCE)
    except OSError as exc:
        native_build_failed(f"no C compiler for the avx512 build ({exc})")
    assert path.stat().st_size > 0


def test_opt_out_and_missing_compiler_fall_back(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")
    with pytest.raises(RuntimeError, match=NATIVE_ENV):
        make_backend("cpu_paged", 4, 2, 16, CPU, head_dim=64)
    monkeypatch.delenv(NATIVE_ENV)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv(CAPABILITY_ENV, "default")
    _library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no C compiler"):
            make_backend("cpu_paged", 4, 2, 16, CPU, head_dim=64)
    finally:
        _library.cache_clear()
    with pytest.raises(RuntimeError, match="head_dim % 16"):
        make_backend("cpu_paged", 4, 2, 16, CPU, head_dim=24)
    with pytest.raises(RuntimeError, match="CPU only"):
        make_backend("cpu_paged", 4, 2, 16, torch.device("cuda"), head_dim=64)


def _shared_layout(prefix_blocks, rows, block_size, rng):
    """rows = [(shared, start, q_len)]: ``shared`` True: the row's table starts with the shared prefix blocks."""
    return _layout([(start, q_len) for _, start, q_len in rows], block_size, rng, prefix_blocks=prefix_blocks,
                   shared={i for i, (on, _, _) in enumerate(rows) if on})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads", [(16, 9, 3), (7, 8, 2), (32, 4, 4)])
def test_decodes_sharing_prefix_blocks_read_them_once_and_match_torch(capability, dtype, block_size, num_heads,
                                                                     num_kv_heads):
    prefix_blocks = -(-300 // block_size)
    shared = prefix_blocks * block_size
    # 7 decodes on the shared prefix (own tails of 1 to 90 tokens, one right at the prefix's end), a decode and
    # a chunk on other blocks, and a chunk after the shared prefix (never grouped: not a decode)
    rows = [(True, shared + t, 1) for t in (0, 1, 5, 16, 17, 40, 89)]
    rows += [(False, 500, 1), (False, 0, 30), (True, shared + 3, 12)]
    layout, slots, num_blocks = _shared_layout(prefix_blocks, rows, block_size, random.Random(block_size))
    groups = cpu_paged.shared_prefix_groups(layout)
    assert groups == [([0, 1, 2, 3, 4, 5, 6], shared)]
    q, k, v, cache = _inputs(layout, num_blocks * block_size, num_heads, num_kv_heads, 64, block_size, dtype)
    backend = _backend(num_heads, num_kv_heads, block_size, 64, "fast")
    assert backend.share_prefixes
    got, _, _ = _attend(backend, layout, slots, q, k, v, cache)
    want, _, _ = _attend(TORCH_BACKEND, layout, slots, q, k, v, cache)
    _close_to_torch(got, want, dtype)
    backend.share_prefixes = False
    alone, _, _ = _attend(backend, layout, slots, q, k, v, cache)
    _close_to_torch(alone, want, dtype)


def _close_to_torch(got, want, dtype):
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_shared_prefix_groups_need_two_rows_whole_blocks_and_no_window():
    rng = random.Random(0)
    layout, _, _ = _shared_layout(8, [(True, 128, 1), (True, 200, 1), (False, 300, 1)], 16, rng)
    assert cpu_paged.shared_prefix_groups(layout) == [([0, 1], 128)]  # row 0's own token sits in block 8
    layout, _, _ = _shared_layout(8, [(True, 127, 1), (True, 200, 1)], 16, rng)
    assert cpu_paged.shared_prefix_groups(layout) == []  # row 0 is inside the prefix: 7 whole blocks < 128 keys
    layout, _, _ = _shared_layout(16, [(True, 300, 1)], 16, rng)
    assert cpu_paged.shared_prefix_groups(layout) == []  # one row: nothing to share
    layout, _, _ = _shared_layout(16, [(True, 300, 1), (True, 400, 1)], 16, rng)
    layout.sliding_window = 1000
    assert cpu_paged.shared_prefix_groups(layout) == []


def test_deterministic_mode_never_groups(capability):
    layout, slots, num_blocks = _shared_layout(20, [(True, 330, 1), (True, 340, 1)], 16, random.Random(1))
    q, k, v, cache = _inputs(layout, num_blocks * 16, 8, 2, 64, 1)
    exact = _backend(8, 2, 16, 64, True)
    meta_upload = StepUpload(CPU)
    meta_upload.add("slot_mapping", slots)
    assert exact.build(layout, meta_upload).num_shared == 0
    got, _, _ = _attend(exact, layout, slots, q, k, v, cache)
    # each row's bits are those of the row alone (batch-invariant)
    for i in range(2):
        one = StepLayout([0], [1], [layout.seq_lens[i]], [layout.block_tables[i]], 1, 16)
        alone, _, _ = _attend(exact, one, [slots[i]], q[i:i + 1], k[i:i + 1], v[i:i + 1], cache)
        assert torch.equal(alone[0], got[i])
