"""What an ``LLMEngine`` does differently as one rank of a tensor-parallel group (world > 1).

Every rank must schedule and sample the same steps, so what depends on wall time or per-process state is made
the same or turned off:

- ``speculative: auto`` is off (its plan is fitted to each process's own step timings); ``ngram`` stays (its
  drafts follow the tokens alone). A draft model (``speculative`` = a model source) is refused: its planner is
  timed like ``auto`` (replicating it on every rank would also cost every rank its whole weights).
- late readback (``late_readback``) is off: every step is read at once.
- the number of KV blocks is the smallest any rank can hold (all-reduce MIN), so every rank's scheduler sees
  the same pool and ``max_model_len``.
- the seed of an unseeded request is drawn by the leader and sent with it (a follower's seed stream never
  counts); prompts are tokenized by the leader only.
- each step's schedule is checked by the fingerprint all-reduce before the model runs
  (:func:`~jobrunner.engine.parallel.commands.check_agreement`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobrunner.engine.config import EngineConfig, is_draft_source
from jobrunner.engine.parallel.commands import agree_min, check_agreement, fingerprint
from jobrunner.engine.parallel.group import object_group

if TYPE_CHECKING:
    from jobrunner.engine.scheduler import SchedulerOutput
    from jobrunner.models.parallel import TensorParallel


def is_parallel(tp: TensorParallel | None) -> bool:
    """Whether ``tp`` is a group of more than one rank."""
    return tp is not None and tp.world > 1


def check_rank_config(config: EngineConfig, tp: TensorParallel | None) -> None:
    """ValueError naming the setting a rank of a group cannot run."""
    if not is_parallel(tp):
        return
    if is_draft_source(config.speculative):
        raise ValueError(f"engine.speculative = a draft model ({config.speculative!r}) is not supported with "
                         f"engine.tensor_parallel_size {tp.world}: use off, ngram or auto (auto is off with "
                         "tensor parallel)")
    if config.pipeline_parallel_size > 1:
        raise ValueError("engine.pipeline_parallel_size > 1 is not supported by the jobrunner engine "
                         "(use engine.backend: vllm)")


def agreed_num_blocks(num_blocks: int, tp: TensorParallel | None) -> int:
    """The KV blocks every rank uses: the smallest any rank planned."""
    return agree_min(num_blocks, object_group(tp)) if is_parallel(tp) else num_blocks


def check_step(sched: SchedulerOutput, tp: TensorParallel | None) -> None:
    """The divergence guard of one step (every rank, before the model's collectives)."""
    if is_parallel(tp):
        check_agreement(fingerprint(sched), object_group(tp), "the scheduled step")


def rank_info(tp: TensorParallel | None, weights_bytes: int, kv_bytes: int) -> dict[str, Any]:
    """``model_info`` keys of a rank: its place in the group and its bytes (parameters + buffers, KV cache)."""
    world = tp.world if tp is not None else 1
    return {"tensor_parallel_size": world, "tensor_parallel_rank": tp.rank if tp is not None else 0,
            "rank_weights_bytes": weights_bytes, "rank_kv_bytes": kv_bytes}
