"""The start-up stages a person reads before the first row: Ray, placing workers, loading, warming up."""

from __future__ import annotations

import json
import os
from typing import Any

from jobrunner.driver.actor import worker_resources
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec
from jobrunner.startup_view import describe_stages


def describe_ray_start(spec: JobSpec, address: str | None) -> str:
    """'starting a local Ray (N CPUs)' or 'joining the Ray cluster at ADDRESS'."""
    import ray

    if ray.is_initialized():
        return "using the Ray instance already started in this process"
    where = address or spec.cluster.address or os.environ.get("RAY_ADDRESS")
    if where:
        return f"joining the Ray cluster at {redact_text(where)}"
    return "starting a local Ray instance"


def describe_placing(spec: JobSpec, count: int) -> str:
    """'placing 2 workers, each asking {"CPU": 1.0}' (the resources Ray must find for each); a tensor-parallel
    worker says so: 'placing 1 worker of 2 tensor-parallel ranks, each asking a placement group (STRICT_PACK:
    one node) of 2 x {"CPU": 1.0}' (vLLM's: 'placing 1 worker (vLLM, tensor parallel 2 x pipeline 1), ...')."""
    from jobrunner.driver.engine_factory import is_rank_group
    from jobrunner.driver.rank_group import rank_placement, vllm_placement

    workers = f"{count} worker{'s' if count != 1 else ''}"
    e = spec.engine
    if is_rank_group(spec):
        return (f"placing {workers} of {e.tensor_parallel_size} tensor-parallel ranks, each asking "
                f"{rank_placement(spec).describe()}")
    placement = vllm_placement(spec)
    if placement is not None:
        return (f"placing {workers} (vLLM, tensor parallel {e.tensor_parallel_size} x pipeline "
                f"{e.pipeline_parallel_size}), each asking {placement.describe()}")
    return f"placing {workers}, each asking {json.dumps(worker_resources(spec))}"


def describe_loading(worker_id: str, spec: JobSpec) -> str:
    """'worker w0 placed; loading model SOURCE', or for engine.backend openai (nothing loaded: a URL)
    'worker w0 placed; endpoint http://host:8000/v1 model NAME'."""
    endpoint = spec.engine.endpoint
    if spec.engine.backend == "openai" and endpoint is not None:
        return f"worker {worker_id} placed; endpoint {_endpoint_text(endpoint)}"
    return f"worker {worker_id} placed; loading model {spec.model.source}"


def describe_ready(worker_id: str, info: dict[str, Any]) -> str:
    """'worker w0 ready after 12.3s (bfloat16: auto -> bfloat16: amx: ...); warming up (first engine steps)';
    an endpoint's worker: 'worker w0 ready after 1.2s (...); endpoint http://host:8000/v1 model NAME'."""
    stats, model = info.get("stats") or {}, info.get("model") or {}
    startup = stats.get("startup_s")
    after = f" after {startup:.1f}s" if isinstance(startup, (int, float)) else ""
    stages = describe_stages(stats.get("startup_stages_s") or {})
    head = f"worker {worker_id} ready{after}" + (f" ({stages})" if stages else "")
    if model.get("backend") == "openai":
        return head + f"; endpoint {redact_text(str(model.get('endpoint')))} model {model.get('endpoint_model')}"
    dtype = model.get("dtype_reason") or model.get("dtype")
    return head + (f" (dtype {dtype})" if dtype else "") + "; warming up (first engine steps)"


def _endpoint_text(endpoint: Any) -> str:
    return f"{redact_text(endpoint.base_url)} model {endpoint.model}"
