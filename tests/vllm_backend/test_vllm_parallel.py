"""engine.tensor_parallel_size / pipeline_parallel_size through vLLM: its own arguments of the same names (never a
raw vllm_options entry), the executor that starts its ranks, and on CPU each rank's cores and KV space. No vLLM
needed here (the real TP = 2 job is tests/vllm_backend/test_vllm_tp_job.py)."""

from __future__ import annotations

import pytest

from jobrunner.spec import spec_from_dict
from jobrunner.vllm_backend.mapping import cpu_bind, engine_args, parallel_args, unmapped_settings, vllm_env

CPU_ENV = ("VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE",
           "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND")


def _spec(tmp_path, engine=None, cluster=None):
    data = {"name": "v", "model": {"source": "smollm2-135m-instruct"},
            "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
            "engine": {"backend": "vllm", **(engine or {})}, "cluster": cluster or {},
            "output": {"url": str(tmp_path / "out")}}
    return spec_from_dict(data)


def test_the_engine_keys_become_vllms_parallel_arguments(tmp_path):
    spec = _spec(tmp_path, {"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, {"num_gpus_per_worker": 8})
    args = engine_args(spec, "/m", "bfloat16", device="cuda")
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (4, 2)
    assert args["distributed_executor_backend"] == "mp"  # a process per rank over the actor's GPUs
    one = engine_args(_spec(tmp_path), "/m", "bfloat16", device="cuda")
    assert not {"tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend"} & set(one)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_vllm_options_may_not_set_them(tmp_path, name):
    with pytest.raises(ValueError, match=f"engine.vllm_options.{name}: set by jobrunner from the spec; use "
                                         f"engine.{name}"):
        _spec(tmp_path, {"vllm_options": {name: 2}}, {"num_gpus_per_worker": 2})
    spec = _spec(tmp_path, {"tensor_parallel_size": 2}, {"num_gpus_per_worker": 2})
    assert unmapped_settings(spec) == []


def test_the_executor_follows_where_the_gpus_are(tmp_path):
    spec = _spec(tmp_path, {"tensor_parallel_size": 8, "pipeline_parallel_size": 2}, {"num_gpus_per_worker": 16})
    assert parallel_args(spec, "cuda", visible_gpus=16)["distributed_executor_backend"] == "mp"
    placement = {"placement_group_id": "ab" * 18, "address": "10.0.0.1:6379"}
    across = parallel_args(spec, "cuda", visible_gpus=0, placement=placement)  # stages on other nodes
    assert across == {"distributed_executor_backend": "ray", "tensor_parallel_size": 8, "pipeline_parallel_size": 2}
    with pytest.raises(ValueError, match="= 16 GPUs, but this worker sees 8 and runs in no placement group"):
        parallel_args(spec, "cuda", visible_gpus=8)


def test_cpu_ranks_bind_their_own_cores_each_with_its_kv_space(tmp_path, monkeypatch):
    for name in CPU_ENV:
        monkeypatch.delenv(name, raising=False)
    spec = _spec(tmp_path, {"tensor_parallel_size": 2, "kv_cache_memory_bytes": 4 * 2**30},
                 {"num_cpus_per_worker": 2})
    assert vllm_env(spec, cores=[0, 1]) == {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # 4 GiB on each rank, as ours
    assert engine_args(spec, "/m", "float32")["distributed_executor_backend"] == "mp"
    wide = _spec(tmp_path, {"tensor_parallel_size": 2}, {"num_cpus_per_worker": 8})
    env = vllm_env(wide, cores=list(range(4, 16)))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "4,5,6,7|8,9,10,11" and env["OMP_NUM_THREADS"] == "4"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # the default, per rank
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")  # the operator's environment wins
    assert "VLLM_CPU_OMP_THREADS_BIND" not in vllm_env(wide, cores=list(range(16)))


def test_cpu_bind_refuses_fewer_cores_than_ranks():
    assert cpu_bind(3, 3, [2, 5, 9, 11]) == "2|5|9"
    with pytest.raises(ValueError, match="3 vLLM ranks need a core each; this worker may use 2"):
        cpu_bind(3, 3, [0, 1])
