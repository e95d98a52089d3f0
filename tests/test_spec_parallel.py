"""The spec's rules for a worker split over ranks (jobrunner/spec_parallel.py): GPUs = tensor x pipeline ranks,
pipeline stages on vLLM only, a core per CPU rank; each refusal names both numbers and the fix."""

from __future__ import annotations

import pytest

from jobrunner.spec import spec_from_dict


def _spec(engine=None, cluster=None):
    return spec_from_dict({"name": "p", "model": {"source": "smollm2-135m-instruct"},
                           "input": {"url": "in.parquet", "prompt_column": "prompt"}, "engine": engine or {},
                           "cluster": cluster or {}, "output": {"url": "out"}})


@pytest.mark.parametrize(("engine", "cluster"), [
    ({"tensor_parallel_size": 8}, {"num_gpus_per_worker": 8}),
    ({"backend": "vllm", "tensor_parallel_size": 8}, {"num_gpus_per_worker": 8}),
    ({"backend": "vllm", "tensor_parallel_size": 4, "pipeline_parallel_size": 2}, {"num_gpus_per_worker": 8}),
    ({"tensor_parallel_size": 2}, {"num_cpus_per_worker": 2}),
    ({}, {"num_gpus_per_worker": 0.5}),  # one rank on half a card
    ({"vllm_python": "~/vllm-venv/bin/python"}, {}),  # kept for `--set engine.backend=vllm`
])
def test_shapes_that_hold(engine, cluster):
    spec = _spec(engine, cluster)
    assert spec.engine.tensor_parallel_size * spec.engine.pipeline_parallel_size >= 1


@pytest.mark.parametrize(("engine", "cluster", "message"), [
    ({"tensor_parallel_size": 4}, {"num_gpus_per_worker": 8},
     "cluster.num_gpus_per_worker 8 but engine.tensor_parallel_size 4 x engine.pipeline_parallel_size 1 = 4 ranks: "
     "each rank takes one GPU, so set cluster.num_gpus_per_worker: 4 (or engine.tensor_parallel_size: 8)"),
    ({"backend": "vllm", "tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {"num_gpus_per_worker": 8},
     "= 4 ranks: each rank takes one GPU, so set cluster.num_gpus_per_worker: 4 (or engine.tensor_parallel_size: 4)"),
    ({}, {"num_gpus_per_worker": 2},
     "cluster.num_gpus_per_worker 2 but engine.tensor_parallel_size 1: a worker's model runs on one GPU unless it "
     "is split; set engine.tensor_parallel_size: 2"),
    ({"pipeline_parallel_size": 2}, {"num_gpus_per_worker": 2},
     "engine.pipeline_parallel_size 2: pipeline stages run on engine.backend vllm only"),
    ({"backend": "vllm", "tensor_parallel_size": 2}, {"num_cpus_per_worker": 1},
     "cluster.num_cpus_per_worker 1 but engine.tensor_parallel_size 2 x engine.pipeline_parallel_size 1 = 2 ranks: "
     "each CPU rank needs a core at least; set cluster.num_cpus_per_worker: 2 or more"),
])
def test_shapes_refused_naming_both_numbers(engine, cluster, message):
    with pytest.raises(ValueError, match="invalid job spec") as info:
        _spec(engine, cluster)
    assert message in str(info.value)
