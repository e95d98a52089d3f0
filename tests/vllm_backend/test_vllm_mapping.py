"""engine.backend vllm: the spec mapped to vLLM setting by setting, and every setting without a vLLM equivalent
refused by name (before any worker starts). No vLLM needed here."""

from __future__ import annotations

import dataclasses

import pytest

from jobrunner.driver.resume_check import spec_differences
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.spec import spec_from_dict
from jobrunner.vllm_backend.engine import vllm_sampling
from jobrunner.vllm_backend.mapping import cpu_preload, engine_args, unmapped_settings, vllm_env


def _spec(tmp_path, engine=None, model=None, **top):
    data = {"name": "v", "model": {"source": "smollm2-135m-instruct", **(model or {})},
            "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
            "engine": {"backend": "vllm", **(engine or {})}, "output": {"url": str(tmp_path / "out")}, **top}
    return spec_from_dict(data)


@pytest.mark.parametrize(("where", "value", "named"), [
    ("engine", {"attention_backend": "torch"}, "engine.attention_backend torch"),
    ("engine", {"deterministic": True}, "engine.deterministic"),
    ("engine", {"speculative": "smollm2-135m-instruct"}, "engine.speculative with a draft model"),
    ("engine", {"factory": "a.b:c"}, "engine.factory"),
    ("engine", {"vllm_options": {"max_num_seqs": 8}}, "engine.vllm_options.max_num_seqs: set by jobrunner"),
    ("model", {"quantization": "int8"}, "model.quantization int8"),
    ("model", {"adapters": {"a": "/x"}}, "model.adapters"),
    ("top", {"task": "embed"}, "task embed"),
])
def test_each_setting_without_a_vllm_equivalent_is_refused_by_name(tmp_path, where, value, named):
    kwargs = {"engine": value} if where == "engine" else {"model": value} if where == "model" else value
    with pytest.raises(ValueError, match="engine.backend vllm: ") as info:
        _spec(tmp_path, **kwargs)
    assert named in str(info.value)


def test_vllm_settings_belong_to_the_vllm_backend(tmp_path):
    with pytest.raises(ValueError, match="apply to engine.backend vllm only"):
        _spec(tmp_path, engine={"backend": "jobrunner", "vllm_options": {"tensor_parallel_size": 2}})


def test_engine_settings_map_to_vllm_names(tmp_path):
    spec = _spec(tmp_path, engine={"max_num_seqs": 8, "max_num_batched_tokens": 512, "enable_prefix_caching": False,
                                   "max_model_len": 1024, "num_kv_blocks": 40, "speculative": "ngram",
                                   "num_speculative_tokens": 3, "use_cuda_graphs": True,
                                   "vllm_options": {"swap_space": 2}},
                 model={"quantization": "fp8"})
    assert unmapped_settings(spec) == []
    args = engine_args(spec, "/models/m", "bfloat16")
    assert args == {"model": "/models/m", "dtype": "bfloat16", "seed": 0, "enforce_eager": False,
                    "max_num_seqs": 8, "max_num_batched_tokens": 512, "enable_prefix_caching": False,
                    "max_model_len": 1024, "gpu_memory_utilization": 0.85, "num_gpu_blocks_override": 40,
                    "quantization": "fp8", "swap_space": 2,
                    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                           "prompt_lookup_min": 1}}


def test_defaults_leave_vllm_its_own_block_size_and_run_eager(tmp_path):
    args = engine_args(_spec(tmp_path), "/m", "float32")
    assert "block_size" not in args and args["enforce_eager"] is True and "speculative_config" not in args
    assert engine_args(_spec(tmp_path, engine={"block_size": 64}), "/m", "float32")["block_size"] == 64
    assert "kv_cache_dtype" not in args  # auto: vLLM's own default (the model's dtype)
    fp8 = _spec(tmp_path, engine={"kv_cache_dtype": "fp8_e4m3"})
    assert unmapped_settings(fp8) == [] and engine_args(fp8, "/m", "bfloat16")["kv_cache_dtype"] == "fp8_e4m3"


def test_the_cpu_environment_follows_the_worker(tmp_path, monkeypatch):
    for name in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
                 "VLLM_ENABLE_V1_MULTIPROCESSING"):
        monkeypatch.delenv(name, raising=False)
    spec = _spec(tmp_path, engine={"kv_cache_memory_bytes": 2 * 2**30}, cluster={"num_cpus_per_worker": 3})
    assert vllm_env(spec) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                              "OMP_NUM_THREADS": "3", "VLLM_CPU_KVCACHE_SPACE": "2"}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the operator's environment wins
    assert "OMP_NUM_THREADS" not in vllm_env(spec)


def test_cpu_preload_names_the_libraries_that_exist(tmp_path, monkeypatch):
    venv, system = tmp_path / "venv", tmp_path / "syslib"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    system.mkdir()
    python = str(venv / "bin" / "python")
    assert cpu_preload(python, (str(system),)) == ""  # neither installed: nothing preloaded
    (system / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert cpu_preload(python, (str(system),)) == str(system / "libtcmalloc_minimal.so.4")
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    both = f"{system / 'libtcmalloc_minimal.so.4'}:{venv / 'lib' / 'libiomp5.so'}"
    assert cpu_preload(python, (str(system),)) == both
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr("jobrunner.vllm_backend.mapping.TCMALLOC_DIRS", (str(system),))
    spec = _spec(tmp_path)
    assert vllm_env(spec, python, "cpu")["LD_PRELOAD"] == both
    assert "LD_PRELOAD" not in vllm_env(spec, python, "cuda")  # GPU builds need neither
    monkeypatch.setenv("LD_PRELOAD", "/x.so")  # the operator's environment wins
    assert "LD_PRELOAD" not in vllm_env(spec, python, "cpu")


def test_every_sampling_field_has_a_vllm_counterpart():
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, n=2,
                            stop=("\n\n",), stop_token_ids=(7,), include_stop_str_in_output=True, ignore_eos=True,
                            min_tokens=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1,
                            logit_bias={5: -1.0}, logprobs=3, prompt_logprobs=1, skip_special_tokens=False,
                            json_schema={"type": "object"})
    sampling, structured = vllm_sampling(params)
    assert sampling == {"n": 2, "max_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
                        "seed": 3, "stop": ["\n\n"], "stop_token_ids": [7], "include_stop_str_in_output": True,
                        "ignore_eos": True, "min_tokens": 0, "presence_penalty": 0.5, "frequency_penalty": 0.25,
                        "repetition_penalty": 1.1, "logit_bias": {"5": -1.0}, "logprobs": 3, "prompt_logprobs": 1,
                        "skip_special_tokens": False}
    assert structured == {"json": {"type": "object"}}
    assert vllm_sampling(SamplingParams(min_tokens=2))[0]["min_tokens"] == 2
    assert vllm_sampling(SamplingParams(regex="[ab]+"))[1] == {"regex": "[ab]+"}
    assert vllm_sampling(SamplingParams(choice=("yes", "no")))[1] == {"choice": ["yes", "no"]}
    # a field added to SamplingParams must be mapped here too (or refused): the list is exhaustive
    mapped = set(sampling) | {"json_schema", "regex", "choice", "extra"}
    assert {f.name for f in dataclasses.fields(SamplingParams)} <= mapped


def test_an_output_is_resumed_only_by_the_engine_that_wrote_it():
    old = {"engine": {}, "model": {}, "sampling": {}, "input": {}}
    new = {"engine": {"backend": "vllm"}, "model": {}, "sampling": {}, "input": {}}
    assert ("engine.backend", "jobrunner", "vllm") in spec_differences(old, new)
    assert not [d for d in spec_differences(old, {**new, "engine": {"backend": "jobrunner"}})
                if d[0] == "engine.backend"]


def test_reports_name_the_engine_that_wrote_an_output():
    from jobrunner.reports.manifest_view import model_info

    assert model_info({"model": {"backend": "vllm", "vllm_version": "0.32.0"}})["engine"] == "vllm 0.32.0"
    assert model_info({"model": {"source": "x"}})["engine"] == "jobrunner"  # outputs from before backends


def test_on_cuda_vllm_runs_its_graphs_and_its_engine_core_process(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    spec = _spec(tmp_path)
    assert spec.engine.use_cuda_graphs == "auto"
    assert engine_args(spec, "/m", "bfloat16", device="cuda")["enforce_eager"] is False  # auto: graphs + compile
    assert engine_args(spec, "/m", "bfloat16", device="cpu")["enforce_eager"] is True  # compiling costs minutes
    eager = _spec(tmp_path, engine={"use_cuda_graphs": False})
    assert engine_args(eager, "/m", "bfloat16", device="cuda")["enforce_eager"] is True
    forced = _spec(tmp_path, engine={"use_cuda_graphs": True})
    assert engine_args(forced, "/m", "float32", device="cpu")["enforce_eager"] is False
    assert vllm_env(spec, device="cuda") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # no CPU settings, no preload
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the operator's environment wins
    assert vllm_env(spec, device="cuda") == {}
