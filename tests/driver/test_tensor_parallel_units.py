"""The parts of a tensor-parallel worker that need no Ray running (driver/rank_group.py, driver/cores.py,
driver/session.py): bundles, cores claimed per rank, what counts as a lost rank, the local fit check."""

from __future__ import annotations

import os

import pytest

from jobrunner.driver.cores import claim_cores, cores_per_rank
from jobrunner.driver.engine_factory import vllm_placement_here
from jobrunner.driver.rank_group import _death, bundle_of_rank, is_collective_failure, rank_placement, vllm_placement
from jobrunner.driver.session import group_fit_problem
from jobrunner.spec import spec_from_dict


def _spec(tmp_path, engine: dict, cluster: dict):
    return spec_from_dict({"name": "t", "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
                           "engine": engine, "cluster": cluster, "output": {"url": str(tmp_path / "out")}})


def test_bundles_split_the_worker_per_rank(tmp_path):
    cpu = _spec(tmp_path, {"tensor_parallel_size": 2}, {"num_cpus_per_worker": 8})
    assert bundle_of_rank(cpu) == {"CPU": 4.0} and vllm_placement(cpu) is None
    group = rank_placement(cpu)
    assert (group.bundles, group.strategy, group.actor) == ([{"CPU": 4.0}] * 2, "STRICT_PACK", {"CPU": 4.0})
    assert group.describe() == 'a placement group (STRICT_PACK: one node) of 2 x {"CPU": 4.0}'
    vllm = _spec(tmp_path, {"backend": "vllm", "tensor_parallel_size": 2}, {"num_cpus_per_worker": 4})
    one = vllm_placement(vllm)  # one actor: one bundle that holds it all
    assert (one.bundles, one.strategy, one.actor) == ([{"CPU": 4.0}], "STRICT_PACK", {"CPU": 4.0})
    assert vllm_placement(_spec(tmp_path, {"backend": "vllm"}, {})) is None


def test_vllm_pipeline_stages_on_gpus_get_one_bundle_per_rank_across_nodes(tmp_path):
    tp_only = _spec(tmp_path, {"backend": "vllm", "tensor_parallel_size": 4},
                    {"num_gpus_per_worker": 4, "num_cpus_per_worker": 8})
    assert vllm_placement(tp_only).bundles == [{"CPU": 8.0, "GPU": 4.0}]  # the actor holds the 4 GPUs
    stages = _spec(tmp_path, {"backend": "vllm", "tensor_parallel_size": 2, "pipeline_parallel_size": 2},
                   {"num_gpus_per_worker": 4, "num_cpus_per_worker": 8})
    placed = vllm_placement(stages)
    assert placed.bundles == [{"CPU": 8.0, "GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert placed.strategy == "PACK" and placed.actor == {"CPU": 8.0}  # every GPU left to vLLM's ranks
    assert placed.describe().startswith("a placement group (PACK: as few nodes as fit) of [{")
    assert vllm_placement_here(tp_only) is None  # no Ray executor: vLLM's ranks are processes of the node


def test_the_local_fit_check_names_what_one_group_lacks(tmp_path):
    spec = _spec(tmp_path, {"tensor_parallel_size": 2}, {"num_cpus_per_worker": 4})
    assert group_fit_problem(spec, {"CPU": 4.0}) is None
    assert group_fit_problem(spec, {"CPU": 2.0}) == (
        "engine.tensor_parallel_size=2 x pipeline_parallel_size=1: one worker's placement group needs 4 CPU on "
        "one node; this machine's local Ray has 2 CPU")
    assert group_fit_problem(_spec(tmp_path, {}, {"num_cpus_per_worker": 64}), {"CPU": 2.0}) is None  # no group


def test_cores_per_rank_is_the_bundles_share_at_least_one():
    assert [cores_per_rank(c, w) for c, w in [(2, 2), (1, 2), (8, 2), (6, 4)]] == [1, 1, 4, 1]


def test_ranks_claim_distinct_cores_and_a_closed_claim_frees_them(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    first = claim_cores(1, tmp_path)
    second = claim_cores(1, tmp_path)  # another descriptor: the flock of the first one holds its core
    assert first.cores == (allowed[0],) and second.cores == (allowed[1],)
    assert claim_cores(len(allowed), tmp_path).cores == ()  # not enough free: nothing pinned, nothing held
    first.release()
    assert claim_cores(1, tmp_path).cores == (allowed[0],)
    second.release()


def test_a_collective_failure_is_a_lost_rank_an_engine_error_is_a_crash():
    gloo = ("RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:5301. This is typically caused by a remote worker crashing.")
    assert is_collective_failure(gloo) and is_collective_failure("DistBackendError: NCCL error in: ...")
    assert not is_collective_failure("IndexError: index out of range in self")
    died = Exception("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
                     "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. Some ...")
    assert _death(died) == "SYSTEM_ERROR, Worker unexpectedly exits with a connection error code 2."


def test_rank_0s_death_is_named_with_its_node_and_pid():
    from jobrunner.driver.rank_group import RankGroup

    group = RankGroup(None, None, [None], {}, {}, known={0: {"rank": 0, "node": "n1", "pid": 14140}})
    ray_text = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
                "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes")
    assert group.leader_lost(ray_text) == ("rank 0 of 2 lost (node n1, pid 14140): its process died (SYSTEM_ERROR, "
                                           "Worker unexpectedly exits with a connection error code 2.)")


def test_placing_line_names_the_tensor_parallel_group(tmp_path):
    from jobrunner.driver.progress_text import describe_placing

    ours = _spec(tmp_path, {"tensor_parallel_size": 2}, {"num_cpus_per_worker": 2})
    assert describe_placing(ours, 1) == ('placing 1 worker of 2 tensor-parallel ranks, each asking a placement '
                                         'group (STRICT_PACK: one node) of 2 x {"CPU": 1.0}')
    vllm = _spec(tmp_path, {"backend": "vllm", "tensor_parallel_size": 2}, {"num_cpus_per_worker": 2})
    assert describe_placing(vllm, 1) == ('placing 1 worker (vLLM, tensor parallel 2 x pipeline 1), each asking a '
                                         'placement group (STRICT_PACK: one node) of 1 x {"CPU": 2.0}')
    assert describe_placing(_spec(tmp_path, {}, {}), 2) == 'placing 2 workers, each asking {"CPU": 1.0}'
