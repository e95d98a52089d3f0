"""Tensor-parallel workers through `jobrunner run` (issue 45, driver/rank_group.py): a worker of
`engine.tensor_parallel_size: 2` is two Ray actors in one placement group on the shared local Ray (2 CPUs, one
core per rank), running a tiny random Llama in float32. The job's rows come out once, with the texts a TP = 1
engine gives; a follower rank killed with SIGKILL mid-job fails its group, which is rebuilt, and the manifest
names the lost rank."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import ray

from jobrunner.driver.job import run_job
from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
from jobrunner.io.parts import read_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import read_manifest_file, write_prompts

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 8


def _spec(model_dir, tmp_path, n_rows: int, **engine) -> tuple[list[str], dict]:
    ids = write_prompts(tmp_path / "in.parquet", n_rows)
    return ids, {"name": "tp-job", "model": {"source": str(model_dir), "dtype": "float32"},
                 "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                           "rows_per_shard": 8},
                 "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
                 "engine": {"max_num_seqs": 4, "num_kv_blocks": 64, "tensor_parallel_size": 2, **engine},
                 "cluster": {"num_workers": 1, "num_cpus_per_worker": 2, "retry_backoff_s": 0.1},
                 "output": {"url": str(tmp_path / "out"), "mode": "overwrite"}}


def _texts(out) -> dict[str, str]:
    rows = read_output(str(out)).to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "a row came out twice"
    return {r["id"]: r["generated_text"] for r in rows}


def _reference(model_dir, n_rows: int, max_tokens: int = MAX_TOKENS) -> dict[str, str]:
    """The same prompts through one TP = 1 engine in this process, greedy."""
    engine = LLMEngine.from_source(str(model_dir), dtype="float32",
                                   config=EngineConfig(device="cpu", max_num_seqs=4, num_kv_blocks=64))
    prompts = [f"question {i} about things" for i in range(n_rows)]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {f"p{i:03d}": o.text for i, o in enumerate(outputs)}


@pytest.mark.heavy  # the fault test below runs the same job (and checks the same texts) with a rank killed
def test_a_tensor_parallel_job_gives_every_row_once_as_tp1_would(local_ray, tiny_llama_hf_dir, tmp_path):
    ids, data = _spec(tiny_llama_hf_dir, tmp_path, 12)
    result = run_job(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    texts = _texts(tmp_path / "out")
    assert sorted(texts) == ids
    assert texts == _reference(tiny_llama_hf_dir, 12)
    worker = read_manifest_file(tmp_path / "out")["workers"]["w0"]
    ranks = worker["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and worker["tensor_parallel_size"] == 2
    assert len({r["pid"] for r in ranks}) == 2 and all(r["device"] == "cpu" for r in ranks)
    # each rank pinned one core of its own (the bundle's 1 CPU), or none where another job holds the node's
    pinned = [tuple(r["cores"]) for r in ranks if r["cores"]]
    assert all(len(c) == 1 for c in pinned) and len(set(pinned)) == len(pinned)
    assert all(r["weights_bytes"] > 0 for r in ranks)


def _actor(name_end: str):
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("jobrunner:tp-job:") and entry["name"].endswith(name_end):
            return ray.get_actor(entry["name"], namespace=entry["namespace"])
    return None


def _rows_done(leader) -> int:
    try:
        shards = ray.get(leader.progress.remote(), timeout=10)["shards"]
    except (ray.exceptions.RayError, TimeoutError):
        return 0
    return sum(progress[0] for progress in shards.values())


def _start_and_wait_for_a_row(data: dict, rank_name: str, what: str) -> tuple[threading.Thread, dict, int]:
    """Run the job in a thread until its group has finished a row; (thread, result box, the pid of the rank
    whose actor name ends in ``rank_name``)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(result=run_job(spec_from_dict(data), show_progress=False)))
    thread.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and thread.is_alive():
        leader, rank = _actor(":w0"), _actor(rank_name)
        if leader is not None and rank is not None and _rows_done(leader) >= 1:
            break
        time.sleep(0.1)
    assert thread.is_alive(), f"the job finished before a rank could be {what}"
    return thread, box, ray.get(rank.ping.remote(), timeout=30)["pid"]


def test_a_killed_follower_rank_fails_its_group_which_is_rebuilt(local_ray, tiny_llama_hf_dir, tmp_path):
    ids, data = _spec(tiny_llama_hf_dir, tmp_path, 16, max_num_seqs=1)
    data["sampling"]["max_tokens"] = MAX_TOKENS * 3  # ~400 steps: the kill lands mid-job
    thread, box, pid = _start_and_wait_for_a_row(data, ":w0:rank1", "killed")
    os.kill(pid, signal.SIGKILL)
    thread.join(300)
    result = box["result"]
    assert result.ok, result.summary()
    texts = _texts(tmp_path / "out")
    assert sorted(texts) == ids
    assert texts == _reference(tiny_llama_hf_dir, 16, MAX_TOKENS * 3)  # rows of both groups, as TP = 1 gives
    manifest = read_manifest_file(tmp_path / "out")
    workers = manifest["workers"]
    lost = workers["w0"]["lost"]
    assert lost.startswith("rank 1 of 2 lost (node ") and f"pid {pid}): its process died" in lost, lost
    assert [r["rank"] for r in workers["w1"]["ranks"]] == [0, 1] and "lost" not in workers["w1"]
    assert {r["pid"] for r in workers["w0"]["ranks"]}.isdisjoint(r["pid"] for r in workers["w1"]["ranks"])
    shards = manifest["shards"].values()
    # the shards the lost group held were retried as a lost worker's: not charged to them
    assert all(e["failures"] == 0 for e in shards) and any(e["infra_failures"] == 1 for e in shards)


def test_a_group_the_cluster_cannot_place_ends_the_job_naming_it(local_ray, tiny_llama_hf_dir, tmp_path):
    _, data = _spec(tiny_llama_hf_dir, tmp_path, 4)
    data["cluster"].update(num_cpus_per_worker=4, worker_start_timeout_s=1.0)  # 2 ranks x 2 CPUs: no node has 4
    result = run_job(spec_from_dict(data), show_progress=False)
    assert not result.ok
    assert result.error.startswith("no worker started within cluster.worker_start_timeout_s=1s: the cluster could "
                                   'not give a placement group (STRICT_PACK: one node) of 2 x {"CPU": 2.0} x 1 ('), \
        result.error


@pytest.mark.heavy  # ~40 s: a stopped rank is found by the progress deadline, then the group restarts
def test_a_stopped_follower_rank_is_a_lost_rank_not_a_hang_of_the_rows(local_ray, tiny_llama_hf_dir, tmp_path):
    ids, data = _spec(tiny_llama_hf_dir, tmp_path, 16, max_num_seqs=1)
    data["sampling"]["max_tokens"] = MAX_TOKENS * 3
    data["cluster"]["progress_timeout_s"] = 4.0
    thread, box, pid = _start_and_wait_for_a_row(data, ":w0:rank1", "stopped")
    os.kill(pid, signal.SIGSTOP)
    try:
        thread.join(300)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # the group's removal killed it already, unless the test failed
        except ProcessLookupError:
            pass
    result = box["result"]
    assert result.ok, result.summary()
    assert sorted(_texts(tmp_path / "out")) == ids
    manifest = read_manifest_file(tmp_path / "out")
    lost = manifest["workers"]["w0"]["lost"]
    assert lost.startswith("rank 1 of 2 lost (node ") and f"pid {pid}): it does not answer" in lost, lost
    # a lost rank, not a hang of the rows: nothing was cut around suspects or charged
    shards = manifest["shards"].values()
    assert all(e["failures"] == 0 and "isolation" not in e for e in shards)
    assert any(e["infra_failures"] == 1 for e in shards)


def test_a_vllm_worker_over_two_ranks_asks_one_bundle_of_the_whole_worker(local_ray, tiny_llama_hf_dir, tmp_path):
    _, data = _spec(tiny_llama_hf_dir, tmp_path, 4)
    data["engine"] = {"backend": "vllm", "tensor_parallel_size": 2}
    data["cluster"].update(num_cpus_per_worker=4, worker_start_timeout_s=1.0)  # one actor: one bundle of 4 CPUs
    result = run_job(spec_from_dict(data), show_progress=False)
    assert not result.ok and "a placement group (STRICT_PACK: one node) of 1 x {\"CPU\": 4.0} x 1 (" in result.error


@pytest.mark.heavy  # ~30 s more: the same fault on rank 0
def test_a_killed_rank_0_is_named_as_the_lost_rank(local_ray, tiny_llama_hf_dir, tmp_path):
    ids, data = _spec(tiny_llama_hf_dir, tmp_path, 16, max_num_seqs=1)
    data["sampling"]["max_tokens"] = MAX_TOKENS * 3
    thread, box, pid = _start_and_wait_for_a_row(data, ":w0", "killed")
    os.kill(pid, signal.SIGKILL)
    thread.join(300)
    assert box["result"].ok, box["result"].summary()
    assert sorted(_texts(tmp_path / "out")) == ids
    lost = read_manifest_file(tmp_path / "out")["workers"]["w0"]["lost"]
    assert lost.startswith("rank 0 of 2 lost (node ") and f"pid {pid})" in lost, lost  # not rank 1, which saw it
