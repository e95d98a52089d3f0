"""Decode steps' layers in one native call (models/layer_loop.py): the Python path's bits, which steps and models
take it, and its timers under the profiler. The loop runs on CPUs with AMX (the AMX GEMM and attention kernels)
and on CPUs with AVX-512 BF16 (JOBRUNNER_CPU_CAPABILITY=avx512_bf16, also forced on an AMX CPU: the vdpbf16ps GEMM,
the tile attention kernels on vdpbf16ps); each is skipped where the CPU lacks it, and where it has it a kernel
that does not build fails. The model checks run everywhere."""

from __future__ import annotations

import pytest
import torch
from helpers import run_checked
from tiny import CORPUS, make_hf_model

from jobrunner.attention import amx_prefill
from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
from jobrunner.engine.profile import StepProfiler
from jobrunner.kernels import CAPABILITY_ENV
from jobrunner.models import layer_loop
from jobrunner.models.loader import build_model, load_weights
from jobrunner.models.onednn_linear import reorder_bf16_linears
from tests.components import require_cpu, require_library


@pytest.fixture(params=["amx", "avx512_bf16"])
def loop_cpu(request, monkeypatch) -> str:
    """The capability the loop runs under (forced): skipped where the CPU lacks it; where it has it, the loop's
    kernels must build (tests/components.py)."""
    from jobrunner.models import amx_linear, fused_ops

    capability = request.param
    require_cpu(capability)
    monkeypatch.setenv(CAPABILITY_ENV, capability)
    for lib in (amx_linear._library(), fused_ops.fused_library(), layer_loop._library(), amx_prefill._library()):
        require_library(lib)
    return capability


needs_loop_cpu = pytest.mark.usefixtures("loop_cpu")
SHAPE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
SHAPE_128 = dict(SHAPE, num_attention_heads=4, num_key_value_heads=2, head_dim=128)  # Llama-3 / Qwen2.5's head size


def _model(hf, dtype=torch.bfloat16):
    model = build_model(hf.config, dtype, torch.device("cpu"))
    load_weights(model, hf.state_dict().items())
    if dtype == torch.bfloat16:
        reorder_bf16_linears(model)
    return model


def _engine(model, tokenizer, **config):
    config = {"max_num_seqs": 16, "num_kv_blocks": 256, "attention_backend": "cpu_paged", "speculative": "off",
              **config}
    return LLMEngine(model, tokenizer, EngineConfig(**config), eos_token_ids=[tokenizer.eos_token_id])


def _assert_same_outputs(mine: dict, theirs: dict) -> None:
    """The same tokens, logprobs and top logprobs for every request, bit for bit."""
    for key, out in theirs.items():
        got = mine[key]
        assert got.output_token_ids == out.output_token_ids
        assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in out.logprobs]
        assert [lp.top_logprobs for lp in got.logprobs] == [lp.top_logprobs for lp in out.logprobs]


@pytest.fixture
def counted(monkeypatch):
    """Calls of the loop, and the steps it ran by kind of attention row."""
    calls = {"n": 0, "groups": 0, "decodes": 0, "natives": 0, "chunks": 0}
    real = layer_loop.LayerLoop.run

    def run(self, x, rope, meta, *args, **kwargs):
        calls["n"] += 1
        calls["groups"] = max(calls["groups"], meta.amx_decode_groups)
        for kind, rows in (("decodes", meta.amx_num_decodes), ("natives", meta.num_rows),
                           ("chunks", meta.amx_num_rows)):
            calls[kind] += rows > 0
        return real(self, x, rope, meta, *args, **kwargs)

    monkeypatch.setattr(layer_loop.LayerLoop, "run", run)
    return calls


CASES = {  # name: (engine config, environment, the kinds of attention rows the loop must have run)
    "decodes": ({}, {}, {"decodes"}),
    # prompts chunked into steps of <= 96 tokens: every step fits; chunks after cached prefixes
    "chunked prefill": ({"max_num_batched_tokens": 96}, {}, {"decodes", "chunks"}),
    # decodes on the native kernel (its shared-prefix groups)
    "native decodes": ({}, {amx_prefill.AMX_DECODE_ENV: "0"}, {"natives"}),
    # n-gram drafts: verify rows of several tokens beside decodes
    "ngram": ({"speculative": "ngram"}, {}, {"decodes", "chunks"}),
}


@pytest.mark.parametrize("arch,case,head_dim", [("llama", name, 64) for name in CASES] + [
    ("qwen2", "chunked prefill", 64), ("llama", "decodes", 128), ("llama", "chunked prefill", 128)])
def test_the_loop_gives_the_python_paths_bits(monkeypatch, tokenizer, counted, loop_cpu, arch, case, head_dim):
    """Greedy decodes of 14 prompts (six share a ~140-token header, so some decodes are grouped on their shared
    blocks) with the loop on and off: the same tokens and the same logprobs, bit for bit, for each kind of
    attention row the loop runs (qwen2: the q|k|v bias; head_dim 128: decodes where the capability's decode
    kernel does not take that size, on AMX, run as native rows); steps over the GEMM's row limit keep Python (with
    AMX, 128 rows: prompt steps; with AVX-512 BF16 the prompt chunks run in the loop too)."""
    config, env, kinds = CASES[case]
    if loop_cpu != "amx":
        kinds = kinds | {"chunks"}
    if head_dim not in amx_prefill.DECODE_HEAD_DIMS[loop_cpu] and "decodes" in kinds:
        kinds = (kinds - {"decodes"}) | {"natives"}
    hf = make_hf_model(arch, **(SHAPE if head_dim == 64 else SHAPE_128))
    shared = " ".join(CORPUS[:4])
    prompts = [f"{shared} {CORPUS[5 + i]}" for i in range(6)] + [" ".join(CORPUS[i:i + 3]) for i in range(8)]
    if case == "ngram":  # text that repeats, so the n-gram index proposes drafts
        prompts = [f"{p} {p}" for p in prompts[6:]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    outs, steps = {}, {}
    for setting in ("1", "0"):
        monkeypatch.setenv(layer_loop.LOOP_ENV, setting)
        counted["n"] = 0
        engine = _engine(_model(hf), tokenizer, **config)
        outs[setting] = run_checked(engine, prompts, params)
        steps[setting] = counted["n"]
    assert steps["0"] == 0 and steps["1"] > 0
    assert {kind for kind in ("decodes", "natives", "chunks") if counted[kind]} == kinds
    if case == "decodes":
        assert counted["groups"] > 0  # shared blocks read once per group
    _assert_same_outputs(outs["1"], outs["0"])


@needs_loop_cpu
def test_the_profiler_charges_the_loops_own_timers(monkeypatch, tokenizer, counted):
    monkeypatch.delenv(layer_loop.LOOP_ENV, raising=False)
    engine = _engine(_model(make_hf_model("llama", **SHAPE)), tokenizer)
    for i in range(4):
        engine.add_request(f"r{i}", CORPUS[i], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with StepProfiler(engine) as profiler:
        while engine.has_unfinished_requests():
            engine.step()
    assert counted["n"] > 0
    assert "layer_loop_clock" not in vars(engine.model)  # detached
    decode = profiler.summary()["by_step_kind"]["decode"]["ms_per_step"]
    assert decode["attention"] > 0 and decode["gemm"] > 0 and decode["other"] > 0


def test_models_the_loop_does_not_take_say_why(monkeypatch):
    monkeypatch.delenv(layer_loop.LOOP_ENV, raising=False)
    qwen3 = _model(make_hf_model("qwen3", hidden_size=256, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64))
    assert "not a plain Llama-family decoder" in layer_loop.layer_loop_reason(qwen3)
    narrow = _model(make_hf_model("llama"))  # head_dim 16
    assert "64- or 128-dim heads" in layer_loop.layer_loop_reason(narrow)
    assert layer_loop.layer_loop_reason(_model(make_hf_model("llama", **SHAPE_128))) is None
    fp32 = _model(make_hf_model("llama", **SHAPE), torch.float32)
    assert layer_loop.layer_loop_reason(fp32) == "not a bf16 model on CPU"
    monkeypatch.setenv(layer_loop.LOOP_ENV, "0")
    assert layer_loop.layer_loop_reason(fp32) == f"{layer_loop.LOOP_ENV}=0"


@needs_loop_cpu
def test_a_model_with_adapters_or_a_wrapped_layer_stays_in_python(monkeypatch, tokenizer, counted, tmp_path):
    """LoRA adapters attached (as `lora_adapters:` does, after loading): every step in Python, the adapters
    applied; a layer someone wrapped: refused with the reason."""
    import copy

    from jobrunner.engine.adapters import load_adapters_onto
    from tests.lora_adapters import save_random_adapter

    monkeypatch.delenv(layer_loop.LOOP_ENV, raising=False)
    hf = make_hf_model("llama", **SHAPE)
    save_random_adapter(copy.deepcopy(hf), tmp_path / "a", 0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = _model(hf)
    assert layer_loop.layer_loop_reason(model) is None
    load_adapters_onto(model, {"a": str(tmp_path / "a")})
    engine = _engine(model, tokenizer)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(CORPUS[:3]):
        engine.add_request(f"r{i}", prompt, params, adapter="a" if i == 0 else None)
    done = [out for _ in range(20) for out in engine.step() if out.finished]
    assert len(done) == 3 and not engine.has_unfinished_requests()
    assert counted["n"] == 0
    wrapped = _model(make_hf_model("llama", **SHAPE))
    wrapped.layers[1].mlp = torch.nn.Sequential(wrapped.layers[1].mlp)
    assert "not the plain decoder layer" in layer_loop.layer_loop_reason(wrapped)


@pytest.mark.parametrize("keep_bf16", [(), ("*.o_proj",)])
def test_w8a8_projections_run_in_the_loop_with_the_python_paths_bits(monkeypatch, tokenizer, counted, keep_bf16):
    """A w8a8 model on the AVX-512 VNNI kernel (quant/i8_gemm.py): its projections in the loop, each called
    through its own kernel (every one W8A8; or o_proj kept in bf16 on the packed GEMM beside W8A8 ones), with the
    same tokens and logprobs as the Python path, chunked prompts and decodes."""
    from jobrunner.quant import quantize_model
    from jobrunner.quant.w8a8 import W8A8Linear

    require_cpu("avx512_bf16")
    monkeypatch.setenv(CAPABILITY_ENV, "avx512_bf16")
    monkeypatch.delenv("JOBRUNNER_W8A8_VNNI", raising=False)
    hf = make_hf_model("llama", **SHAPE)

    def w8a8_model():
        model = build_model(hf.config, torch.bfloat16, torch.device("cpu"))
        load_weights(model, hf.state_dict().items())
        quantize_model(model, "w8a8", skip=keep_bf16)
        reorder_bf16_linears(model)
        return model

    probe = w8a8_model()
    assert layer_loop.layer_loop_reason(probe) is None
    kinds = {layer_loop._projection_kind(p) for layer in probe.layers
             for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)}
    assert kinds == ({"vnni", "bf16"} if keep_bf16 else {"vnni"})
    assert isinstance(probe.layers[0].mlp.down_proj, W8A8Linear)  # smoothed: W8A8 too
    prompts = [" ".join(CORPUS[i:i + 4]) for i in range(8)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(layer_loop.LOOP_ENV, setting)
        counted["n"] = 0
        outs[setting] = run_checked(_engine(w8a8_model(), tokenizer, max_num_batched_tokens=64), prompts, params)
        assert (counted["n"] > 0) == (setting == "1")
    _assert_same_outputs(outs["1"], outs["0"])


def test_int4_projections_run_in_the_loop_above_their_tinygemm_rows(monkeypatch, tokenizer, counted):
    """An int4 model on a CPU where W8A8 runs on our GEMM: its projections' W4A8 kernel (jr_i4_linear:
    the int4 blocks expanded and multiplied in one call) in the loop for steps above the layers' tinygemm rows
    (4 there), the Python path below; the same tokens and logprobs as with the loop off."""
    from jobrunner.quant import quantize_model

    require_cpu("avx512_bf16")
    monkeypatch.setenv(CAPABILITY_ENV, "avx512_bf16")
    monkeypatch.delenv("JOBRUNNER_W8A8_VNNI", raising=False)
    hf = make_hf_model("llama", **SHAPE)

    def int4_model():
        model = build_model(hf.config, torch.bfloat16, torch.device("cpu"))
        load_weights(model, hf.state_dict().items())
        quantize_model(model, "int4")
        reorder_bf16_linears(model)
        return model

    probe = int4_model()
    assert layer_loop.layer_loop_reason(probe) is None
    assert layer_loop.LayerLoop(probe).min_rows == 1 + probe.layers[0].mlp.down_proj.small_batch_max_tokens == 5
    prompts = [" ".join(CORPUS[i % 8:i % 8 + 3]) + f" {i}" for i in range(20)]  # 20 rows decode together
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv(layer_loop.LOOP_ENV, setting)
        counted["n"] = 0
        outs[setting] = run_checked(_engine(int4_model(), tokenizer, max_num_seqs=32, max_num_batched_tokens=64),
                                    prompts, params)
        assert (counted["n"] > 0) == (setting == "1")
    _assert_same_outputs(outs["1"], outs["0"])
