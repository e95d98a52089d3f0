"""A spawned tensor-parallel group for the tests (not a test file): ``world`` processes on gloo, each loading its
shard of a checkpoint through ``load_for_engine(..., tensor_parallel=...)`` and running the same greedy
generation through our engine (every rank runs the same scheduler; the model's collectives keep them in step),
recording every step's logits, the tokens and the rank's parameters. :func:`run_case` in this process gives the
world-1 reference."""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from jobrunner.models.parallel import TensorParallel


def run_case(tp: TensorParallel | None, case: dict[str, Any]) -> dict[str, Any]:
    """Load ``case["path"]`` (as rank ``tp``, or whole) and generate greedily; what the comparison needs
    (``case["env"]``: environment variables set while it runs, e.g. the quantized kernels' dispatch)."""
    with _environ(case.get("env", {})):
        return _run_case(tp, case)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_case(tp: TensorParallel | None, case: dict[str, Any]) -> dict[str, Any]:
    from jobrunner.engine import EngineConfig, SamplingParams
    from jobrunner.engine.llm_engine import LLMEngine
    from jobrunner.models.factory import load_for_engine

    model, tokenizer, eos_ids, info = load_for_engine(
        str(case["path"]), dtype=case.get("dtype", "float32"), device="cpu",
        quantization=case.get("quantization", "none"), tensor_parallel=tp)
    steps: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        steps.append(logits.detach().float().clone())
        return logits

    model.compute_logits = recorded
    config = EngineConfig(device="cpu", num_kv_blocks=64, block_size=16, attention_backend=case.get("backend", "torch"),
                          max_num_batched_tokens=case.get("max_num_batched_tokens", 64), max_num_seqs=8)
    engine = LLMEngine(model, tokenizer, config, eos_token_ids=eos_ids)
    prompts = case["prompts"]
    params = SamplingParams(max_tokens=case.get("max_tokens", 6), temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    tensors = {n: (tuple(t.shape), t.numel() * t.element_size()) for n, t in model.state_dict().items()}
    seen, param_bytes = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            param_bytes += p.numel() * p.element_size()
    return {"tokens": [o.output_token_ids for o in outs], "logits": steps, "tensors": tensors,
            "param_bytes": param_bytes, "weights_bytes": info["weights_bytes"],
            "load_rise_bytes": info["load_host_anon_rise_bytes"],
            "heads": (model.shape.num_heads, model.shape.num_kv_heads)}


def rank_main(rank: int, world: int, init_method: str, cases: list[dict[str, Any]], out_dir: str) -> None:
    """One rank: join the gloo group, run every case, save the results (rank 0 keeps the logits)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        tp = TensorParallel(rank, world)
        results = {case["name"]: run_case(tp, case) for case in cases}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_group(world: int, cases: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """Run ``cases`` on ``world`` spawned ranks; each rank's results in rank order."""
    import torch.multiprocessing as mp

    tmp.mkdir(parents=True, exist_ok=True)
    init = f"file://{tmp / 'rendezvous'}"
    mp.spawn(rank_main, args=(world, init, cases, str(tmp)), nprocs=world, join=True)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
