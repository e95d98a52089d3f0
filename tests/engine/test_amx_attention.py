"""bf16 prompt chunks and decodes on the tile kernels (kernels/csrc/attention/amx_attention.c) against attention
computed directly in float64 and against torch's SDPA route and the exact kernel, under each capability that runs
them, forced: AMX (the tiles) and AVX-512 BF16 (the same source with the tile operations on vdpbf16ps,
include/jr_tile_avx512.h). Each is skipped where the CPU lacks it; where it has it, a kernel that does not build
fails (tests/components.py)."""

from __future__ import annotations

import pytest
import torch
from test_torch_prefix_chunks import _reference, _step

from jobrunner.attention import StepUpload, amx_prefill, cpu_paged
from jobrunner.attention.cpu_paged import make_cpu_paged_backend
from jobrunner.attention.torch_backend import TORCH_BACKEND
from jobrunner.kernels import CAPABILITY_ENV
from tests.components import require_cpu, require_library


def _require_tile_kernel(capability: str = "amx") -> None:
    require_cpu(capability)
    require_library(amx_prefill._library())


@pytest.fixture(params=sorted(amx_prefill.LIBRARIES))
def tile_cpu(request, monkeypatch) -> str:
    """Each capability that runs the kernels, forced: skipped where the CPU lacks it; where it has it, the kernel
    must build."""
    monkeypatch.setenv(CAPABILITY_ENV, request.param)
    _require_tile_kernel(request.param)
    return request.param


needs_amx = pytest.mark.usefixtures("tile_cpu")


def _run(backend, layout, slots, q, k, v, k_cache, v_cache, scale):
    upload = StepUpload(q.device)
    upload.add("slot_mapping", slots)
    meta = backend.build(layout, upload)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    return backend.forward(q, k, v, k_cache, v_cache, meta, scale), meta, k_cache, v_cache


def _assert_within_sdpas_error(out, sdpa, want):
    """The kernel's error against the float64 reference within a small factor of torch's bf16 SDPA's."""
    err, sdpa_err = (out.double() - want).abs(), (sdpa.double() - want).abs()
    assert torch.isfinite(out).all()
    assert err.mean().item() < 2.5 * sdpa_err.mean().item()
    assert err.max().item() < 4 * sdpa_err.max().item() + 1e-2


@needs_amx
@pytest.mark.parametrize("head_dim,num_kv_heads,n_rep,block_size", [
    (64, 3, 3, 16), (64, 2, 1, 32), (64, 1, 4, 16), (128, 2, 2, 16), (32, 2, 3, 32)])
def test_amx_chunks_match_direct_attention(head_dim, num_kv_heads, n_rep, block_size):
    """Chunks from position 0 and after cached prefixes (lengths off every tile size, one crossing many
    blocks), D = 64 (the output kept in tiles) and other head sizes (the general path): the error is that of
    torch's bf16 SDPA on the same rows, within a small factor."""
    rows = [(0, 65), (40, 100), (1040, 240), (17, 129), (0, 300), (333, 77)]
    layout, slots, q, k, v, k_cache, v_cache = _step(rows, block_size, num_kv_heads, head_dim, n_rep,
                                                     torch.bfloat16, seed=head_dim + n_rep)
    scale = head_dim ** -0.5
    backend = make_cpu_paged_backend("cpu", head_dim, torch.bfloat16)
    assert backend.amx is not None and "AMX" in backend.chunk_route
    out, meta, k_written, v_written = _run(backend, layout, slots, q, k, v, k_cache, v_cache, scale)
    assert meta.amx_num_rows == len(rows) and not meta.torch_groups  # every row > 64 tokens took the kernel
    want = _reference(layout, q, k_written, v_written, n_rep, scale)
    sdpa, *_ = _run(TORCH_BACKEND, layout, slots, q, k, v, k_cache, v_cache, scale)
    assert out.dtype == torch.bfloat16
    _assert_within_sdpas_error(out, sdpa, want)


@needs_amx
@pytest.mark.parametrize("head_dim", [64, 128])
def test_amx_chunks_with_sharp_scores_rescale_their_output(head_dim):
    """Keys whose scores grow along the row by far more than the lazy maximum's margin (2^8 in base 2), so each
    block's maximum moves many times and the output accumulated so far is rescaled each time: still the
    direct attention within SDPA's error."""
    rows = [(0, 130), (300, 200), (77, 96)]
    layout, slots, q, k, v, k_cache, v_cache = _step(rows, 16, 2, head_dim, 3, torch.bfloat16, seed=7)
    k_cache, k = k_cache.float(), k.float()
    for r, (start, length) in enumerate(rows):  # key p of a row scaled by 0.2 + p / 60 (cached and new)
        for p in range(start + length):
            slot = layout.block_tables[r][p // 16] * 16 + p % 16
            k_cache[slot] *= 0.2 + p / 60
            if p >= start:
                k[layout.query_starts[r] + p - start] *= 0.2 + p / 60
    k_cache, k, q = k_cache.bfloat16(), k.bfloat16(), (q.float() * 4).bfloat16()
    scale = head_dim ** -0.5
    backend = make_cpu_paged_backend("cpu", head_dim, torch.bfloat16)
    out, meta, k_written, v_written = _run(backend, layout, slots, q, k, v, k_cache, v_cache, scale)
    assert meta.amx_num_rows == len(rows)
    want = _reference(layout, q, k_written, v_written, 3, scale)
    sdpa, *_ = _run(TORCH_BACKEND, layout, slots, q, k, v, k_cache, v_cache, scale)
    _assert_within_sdpas_error(out, sdpa, want)


@needs_amx
def test_amx_rows_beside_decodes_and_short_chunks():
    """One step of decodes (the exact kernel: no heads given, so no AMX decode route), a short chunk and long
    chunks (the AMX kernel): each row's output from its own path, all against the direct reference."""
    rows = [(50, 1), (700, 1), (20, 6), (64, 80), (0, 96)]
    layout, slots, q, k, v, k_cache, v_cache = _step(rows, 16, 3, 64, 3, torch.bfloat16, seed=5)
    backend = make_cpu_paged_backend("cpu", 64, torch.bfloat16)
    out, meta, k_written, v_written = _run(backend, layout, slots, q, k, v, k_cache, v_cache, 0.125)
    assert meta.amx_num_rows == 3 and meta.num_rows == 2
    want = _reference(layout, q, k_written, v_written, 3, 0.125)
    assert (out.double() - want).abs().max().item() < 3e-2


@pytest.mark.parametrize("forced,setting,dtype,amx", [
    ("amx", "", torch.bfloat16, True), ("amx", "0", torch.bfloat16, False), ("amx", "", torch.float32, False),
    ("avx512_bf16", "", torch.bfloat16, True), ("avx512_bf16", "0", torch.bfloat16, False),
    ("avx512_vnni", "", torch.bfloat16, False)])
def test_the_amx_route_is_chosen_by_capability(monkeypatch, forced, setting, dtype, amx):
    """With AMX or AVX-512 BF16, bf16 prompt chunks take the tile kernel (JOBRUNNER_ATTENTION_AMX=0: as before,
    torch's SDPA with AMX, the native kernel without); never for float32 or on other CPUs."""
    if not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("the forced AVX-512 builds run on an AVX-512 CPU only")
    monkeypatch.setenv(CAPABILITY_ENV, forced)
    if forced in amx_prefill.LIBRARIES:
        _require_tile_kernel(forced)
    monkeypatch.setenv(amx_prefill.AMX_ENV, setting)
    backend = make_cpu_paged_backend("cpu", 64, dtype)
    assert (backend.amx is not None) == amx
    if amx:
        assert backend.native_max_query == amx_prefill.AMX_MIN_QUERY and "AMX kernel" in backend.chunk_route
    elif dtype == torch.bfloat16 and forced == "amx":
        assert backend.native_max_query == cpu_paged.BF16_SDPA_MIN_QUERY and "SDPA" in backend.chunk_route


def test_the_amx_route_says_why_not(monkeypatch):
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    assert "needs a CPU with AMX" in amx_prefill.amx_unavailable_reason(64)
    if amx_prefill.amx_unavailable_reason(64) is None:
        monkeypatch.setenv(CAPABILITY_ENV, "amx")
        assert "head_dim % 32" in amx_prefill.amx_unavailable_reason(48)


@needs_amx
def test_engine_with_amx_chunks_matches_the_sdpa_route(monkeypatch, tokenizer):
    """A bf16 engine (random Llama with 64-dim heads) whose prompts share a long prefix and are prefilled in
    chunks: with the AMX route on, its chunks run on the kernel (counted), and every row's greedy tokens and
    first-token logprob agree with the SDPA route's within bf16 noise."""
    from helpers import run_checked
    from tiny import CORPUS, make_hf_model

    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
    from jobrunner.models.loader import build_model, load_weights

    hf = make_hf_model("llama", hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    # ~140-token shared header, own parts of ~100 tokens (chunks after a cached prefix), two unrelated prompts
    shared = " ".join(CORPUS[:4])
    prompts = [f"{shared} {' '.join(CORPUS[4 + 3 * i:7 + 3 * i])}" for i in range(6)] + [
        " ".join(CORPUS[30:36]), " ".join(CORPUS[40:44])]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    calls = {"n": 0}
    real_call = amx_prefill.AmxPromptAttention.__call__

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(amx_prefill.AmxPromptAttention, "__call__", counted)
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(amx_prefill.AMX_ENV, setting)
        model = build_model(hf.config, torch.bfloat16, torch.device("cpu"))
        load_weights(model, hf.state_dict().items())
        engine = LLMEngine(model, tokenizer, EngineConfig(max_num_batched_tokens=160, max_num_seqs=8,
                                                          num_kv_blocks=256, attention_backend="cpu_paged",
                                                          speculative="off"),
                           eos_token_ids=[tokenizer.eos_token_id])
        assert (engine.runner.backend.amx is not None) == (setting == "1")
        outs[setting] = run_checked(engine, prompts, params)
        assert engine.stats().num_cached_tokens > 0
        if setting == "1":
            assert calls["n"] > 0
    same = sum(outs["1"][k].output_token_ids == outs["0"][k].output_token_ids for k in outs["0"])
    assert same >= len(prompts) - 1
    first = [abs(outs["1"][k].logprobs[0].logprob - outs["0"][k].logprobs[0].logprob) for k in outs["0"]]
    assert max(first) < 0.1


@pytest.mark.parametrize("n_rep,block_size,head_dim", [(3, 16, 64), (1, 32, 64), (4, 16, 64), (16, 16, 64),
                                                       (4, 16, 128), (3, 32, 128), (16, 16, 128)])
def test_amx_decodes_match_direct_attention(monkeypatch, tile_cpu, n_rep, block_size, head_dim):
    """Decodes on the AMX kernel (every context length around the 16- and 32-key steps, and long ones) beside
    prompt chunks in one step: each against the direct reference, within bf16 noise of the exact kernel; head_dim
    128 where the capability's decode takes it (without AMX)."""
    if head_dim not in amx_prefill.DECODE_HEAD_DIMS[tile_cpu]:
        pytest.skip(f"the {tile_cpu} decode kernel takes head_dim {amx_prefill.DECODE_HEAD_DIMS[tile_cpu]}")
    monkeypatch.setenv(amx_prefill.AMX_DECODE_ENV, "all")
    rows = [(n, 1) for n in (0, 1, 14, 15, 16, 17, 30, 31, 32, 33, 63, 64, 65, 100, 517)] + [(40, 5), (0, 70)]
    num_kv_heads = 2
    layout, slots, q, k, v, k_cache, v_cache = _step(rows, block_size, num_kv_heads, head_dim, n_rep, torch.bfloat16,
                                                     seed=11 + n_rep)
    backend = make_cpu_paged_backend("cpu", head_dim, torch.bfloat16, num_kv_heads * n_rep, num_kv_heads,
                                     block_size)
    assert backend.amx_decode == "all"
    out, meta, k_written, v_written = _run(backend, layout, slots, q, k, v, k_cache, v_cache, 0.125)
    assert meta.amx_num_decodes == 15 and meta.amx_num_rows == 2 and meta.num_rows == 0
    want = _reference(layout, q, k_written, v_written, n_rep, 0.125)
    monkeypatch.setenv(amx_prefill.AMX_DECODE_ENV, "0")
    exact = make_cpu_paged_backend("cpu", head_dim, torch.bfloat16, num_kv_heads * n_rep, num_kv_heads, block_size)
    ref_out, ref_meta, *_ = _run(exact, layout, slots, q, k, v, k_cache, v_cache, 0.125)
    assert ref_meta.amx_num_decodes == 0
    err, exact_err = (out.double() - want).abs(), (ref_out.double() - want).abs()
    assert torch.isfinite(out).all()
    assert err.max().item() < 3 * exact_err.max().item() + 1e-2
    assert err.mean().item() < 3 * exact_err.mean().item()


@pytest.mark.parametrize("n_rep,head_dim", [(3, 64), (4, 64), (16, 64), (3, 128), (16, 128)])
def test_grouped_decodes_read_their_shared_keys_once(monkeypatch, tile_cpu, n_rep, head_dim):
    """Decodes sharing cached blocks (groups larger than one tile of lanes, and a lone row) on the AMX kernel,
    grouped by default: the same outputs as the exact kernel within bf16 noise, and the groups counted."""
    if head_dim not in amx_prefill.DECODE_HEAD_DIMS[tile_cpu]:
        pytest.skip(f"the {tile_cpu} decode kernel takes head_dim {amx_prefill.DECODE_HEAD_DIMS[tile_cpu]}")
    monkeypatch.delenv(amx_prefill.AMX_DECODE_ENV, raising=False)
    rows = [(300, 1), (200, 1), (290, 1), (250, 1), (180, 1), (333, 1), (240, 1), (20, 1), (160, 1), (170, 1)]
    layout, slots, q, k, v, k_cache, v_cache = _step(rows, 16, 2, head_dim, n_rep, torch.bfloat16, seed=n_rep)
    for i in range(1, 7):  # rows 0-6 share their first 10 blocks (160 keys) with row 0: a group of 7
        layout.block_tables[i][:10] = layout.block_tables[0][:10]
    layout.block_tables[9][:9] = layout.block_tables[8][:9]  # rows 8 and 9: 144 shared keys
    backend = make_cpu_paged_backend("cpu", head_dim, torch.bfloat16, 2 * n_rep, 2, 16)
    assert backend.amx_decode == "grouped"
    # the reference reads the cache through each row's table, so shared blocks count for every member
    out, meta, k_written, v_written = _run(backend, layout, slots, q, k, v, k_cache, v_cache, 0.125)
    assert meta.amx_num_decodes == len(rows) and meta.amx_decode_groups == 2 and meta.num_rows == 0
    want = _reference(layout, q, k_written, v_written, n_rep, 0.125)
    monkeypatch.setenv(amx_prefill.AMX_DECODE_ENV, "0")
    exact = make_cpu_paged_backend("cpu", head_dim, torch.bfloat16, 2 * n_rep, 2, 16)
    ref_out, ref_meta, *_ = _run(exact, layout, slots, q, k, v, k_cache, v_cache, 0.125)
    assert ref_meta.num_shared == 2
    err, exact_err = (out.double() - want).abs(), (ref_out.double() - want).abs()
    assert err.max().item() < 3 * exact_err.max().item() + 1e-2
    assert err.mean().item() < 3 * exact_err.mean().item()
    monkeypatch.setenv(amx_prefill.AMX_DECODE_ENV, "all")
    ungrouped = make_cpu_paged_backend("cpu", head_dim, torch.bfloat16, 2 * n_rep, 2, 16)
    all_out, all_meta, *_ = _run(ungrouped, layout, slots, q, k, v, k_cache, v_cache, 0.125)
    assert all_meta.amx_decode_groups == 0
    assert (all_out.double() - want).abs().max().item() < 3 * exact_err.max().item() + 1e-2


def test_the_decode_route_takes_only_shapes_it_fits(monkeypatch):
    monkeypatch.delenv(amx_prefill.AMX_DECODE_ENV, raising=False)
    monkeypatch.setenv(CAPABILITY_ENV, "amx")
    assert amx_prefill.amx_decode_route(64, 9, 3, 16) == "grouped"
    assert amx_prefill.amx_decode_route(128, 32, 8, 16) == ""   # head_dim 128 on the tiles: the exact kernel
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    assert amx_prefill.amx_decode_route(64, 9, 3, 16) == ""     # no tile kernel for this capability
    monkeypatch.setenv(CAPABILITY_ENV, "avx512_bf16")
    assert amx_prefill.amx_decode_route(128, 32, 8, 16) == "grouped"  # without AMX: its own decode takes 128
    assert amx_prefill.amx_decode_route(96, 12, 4, 16) == ""
    assert amx_prefill.amx_decode_route(64, 64, 2, 16) == ""    # 32 query heads per kv head
    assert amx_prefill.amx_decode_route(64, 9, 3, 8) == ""      # blocks of 8
    monkeypatch.setenv(amx_prefill.AMX_DECODE_ENV, "0")
    assert amx_prefill.amx_decode_route(64, 9, 3, 16) == ""
    monkeypatch.setenv(amx_prefill.AMX_DECODE_ENV, "some")
    with pytest.raises(ValueError, match="JOBRUNNER_ATTENTION_AMX_DECODE"):
        amx_prefill.amx_decode_route(64, 9, 3, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_kv_write_matches_index_copy(dtype):
    """cpu_paged writes a step's keys and values (views of the fused qkv projection) with one C loop: the
    same cache as torch's index_copy_, for views and for a contiguous fallback case."""
    from jobrunner.attention.base import write_kv

    reason = cpu_paged.cpu_paged_unavailable_reason("cpu", 64)
    if reason:
        pytest.skip(reason)
    backend = make_cpu_paged_backend("cpu", 64, dtype)
    qkv = torch.randn(7, (4 + 2 * 2) * 64).to(dtype)
    k = qkv[:, 256:384].view(7, 2, 64)
    v = qkv[:, 384:].view(7, 2, 64)
    slots = torch.tensor([5, 0, 17, 3, 30, 31, 8])
    for key, value in ((k, v), (k.contiguous(), v.clone())):
        k_cache, v_cache = torch.zeros(32, 2, 64, dtype=dtype), torch.zeros(32, 2, 64, dtype=dtype)
        backend._write_kv(key, value, k_cache, v_cache, slots)
        k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        write_kv(key, value, k_ref, v_ref, slots)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
