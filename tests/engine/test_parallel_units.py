"""engine/parallel without a group: rank specs, the core split, the schedule fingerprint, what a rank refuses."""

from __future__ import annotations

import pytest

from jobrunner.engine import EngineConfig
from jobrunner.engine.parallel import RankSpec, free_port
from jobrunner.engine.parallel.commands import Control, fingerprint
from jobrunner.engine.parallel.launch import split_cores
from jobrunner.engine.parallel.rank import check_rank_config
from jobrunner.engine.request import Request
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.engine.scheduler import ScheduledRequest, SchedulerOutput
from jobrunner.models.parallel import TensorParallel


def test_rank_spec_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"rank 2 is not in 0..1 \(world 2\)"):
        RankSpec(2, 2, "tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="RankSpec.backend must be one of auto|gloo|nccl, got 'mpi'"):
        RankSpec(0, 2, "tcp://127.0.0.1:1", backend="mpi")
    assert RankSpec(0, 2, "tcp://127.0.0.1:1").resolved_backend() == "gloo"  # no device index: a CPU rank
    assert 0 < free_port() < 65536


@pytest.mark.parametrize(("world", "cores", "expected"), [
    (2, [0, 1], [(0,), (1,)]),
    (2, [4, 5, 6, 7, 8], [(4, 5, 6), (7, 8)]),
    (3, [0, 1], [(0,), (1,), (0,)]),   # fewer cores than ranks: shared round-robin
    (1, [3, 1], [(1, 3)]),
])
def test_cores_split_into_contiguous_groups(world, cores, expected):
    assert split_cores(world, cores) == expected


def _step(*rows: tuple[str, int, int]) -> SchedulerOutput:
    out = SchedulerOutput()
    for request_id, start, num_new in rows:
        request = Request(request_id, list(range(1, 20)), SamplingParams(), 0.0, ())
        out.scheduled.append(ScheduledRequest(request, num_new, start, []))
    return out


def test_the_fingerprint_sees_ids_positions_and_token_counts():
    base = fingerprint(_step(("a", 0, 8), ("b", 0, 4)))
    assert base == fingerprint(_step(("a", 0, 8), ("b", 0, 4)))  # stable across calls (and processes: no hash())
    assert base != fingerprint(_step(("a", 0, 8), ("b", 0, 3)))
    assert base != fingerprint(_step(("a", 0, 8), ("c", 0, 4)))
    assert base != fingerprint(_step(("a", 4, 8), ("b", 0, 4)))
    assert base != fingerprint(_step(("b", 0, 4), ("a", 0, 8)))
    assert 0 <= base < 2**62


def test_a_rank_refuses_a_draft_model_and_pipeline_stages():
    two = TensorParallel(0, 2)
    with pytest.raises(ValueError, match=r"engine.speculative = a draft model .* with engine.tensor_parallel_size 2"):
        check_rank_config(EngineConfig(speculative="HuggingFaceTB/SmolLM2-135M-Instruct"), two)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 is not supported by the jobrunner engine"):
        check_rank_config(EngineConfig(pipeline_parallel_size=2), two)
    check_rank_config(EngineConfig(speculative="ngram"), two)
    check_rank_config(EngineConfig(speculative="HuggingFaceTB/SmolLM2-135M-Instruct"), TensorParallel(0, 1))


def test_control_words_are_checked():
    with pytest.raises(ValueError, match="unknown control word 'stop'"):
        Control("stop")
