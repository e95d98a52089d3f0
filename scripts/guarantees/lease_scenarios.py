"""Lease and rerun guarantees (issue 15, items 1-2), each scenario run for real; one result line per scenario.

Drivers are real `jobrunner run` processes on one local Ray instance, with the instant test engine double
(`tests.driver.fake_engine`, slowed per step so that signals land mid-job) or, for the failed-then-fixed
scenario, the real engine on a tiny random model built here. Racing acquisitions are separate processes
against local disk and a moto S3 server (server mode, 127.0.0.1, a free port).

    PYTHONPATH=. .venv/bin/python scripts/guarantees/lease_scenarios.py            # every scenario
    PYTHONPATH=. .venv/bin/python scripts/guarantees/lease_scenarios.py --only kill9_rerun race_local

Scenarios:
  sigstop_takeover  SIGSTOP driver A past its ttl, run B to completion, SIGCONT A: A stops, writing nothing;
                    the parts are exactly those B's manifest names; every id once.
  race_local/s3     8 processes acquire at the same instant (an empty output, then a stalled holder's
                    lease taken over by all at once): exactly one holder per round.
  skewed_clock      a live holder whose clock is 3 h behind is not taken over; a crashed holder on
                    "another host" whose clock is 3 h ahead is taken over after its ttl, not after 3 h.
  kill9_rerun       kill -9 of the driver, then the same command at once: the lease is taken over at once
                    (same host, pid gone) and the resume starts; every id once.
  failed_then_fixed a run with a typo'd model source fails (nothing committed); the corrected run replaces it.
  ray_job_ended     a job submitted to a Ray head (its own, with a dashboard) is stopped mid-job; `run` of the
                    same job, told it runs on another host (so the pid check cannot prove anything), asks the
                    cluster, sees the Ray job STOPPED and takes the lease over at once (ttl 600 s); every id once.
  rewritten_file    the input file is rewritten while the job runs: the next shards fail naming the file and
                    what changed, the run exits 1; a rerun refuses (the input changed under committed shards);
                    with the original file back the rerun resumes and finishes, every id once.

Not a test: it prints what happened; durations depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[2]
TTL_S = 5.0  # the smallest lease_ttl_s a spec accepts
RACERS = 8


# ---- jobs -------------------------------------------------------------------------------------------------
def write_input(path: Path, num_rows: int) -> list[str]:
    ids = [f"r{i:04d}" for i in range(num_rows)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"question {i} about things" for i in range(num_rows)]}),
                   path, row_group_size=8)
    return ids


def fake_job(work: Path, num_rows: int = 160, step_delay_s: float = 0.1) -> tuple[Path, list[str]]:
    ids = write_input(work / "in.parquet", num_rows)
    spec = {"name": "lease-scenario",
            "input": {"url": str(work / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": 8},
            "sampling": {"max_tokens": 4},
            "engine": {"max_num_seqs": 4, "factory": "tests.driver.fake_engine:make_engine",
                       "factory_options": {"step_delay_s": step_delay_s}},
            "cluster": {"num_workers": 2, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
            "output": {"url": str(work / "out"), "lease_ttl_s": TTL_S}}
    job = work / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    return job, ids


def start_driver(job: Path, address: str, log: Path, prelude: str = "") -> subprocess.Popen:
    """`jobrunner run JOB` in its own process; `prelude` runs first (e.g. to skew its clock)."""
    code = f"{prelude}\nfrom jobrunner.cli import main; main()"
    cmd = [sys.executable, "-c", code, "run", str(job), "--address", address, "--no-progress", "--no-report"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def committed(out: Path) -> set[str]:
    """Committed shard ids, read the way a run reads them (any manifest format, commit records folded in)."""
    from jobrunner.io.manifest import read_manifest_table
    from jobrunner.io.shard_file import COMMITTED
    from jobrunner.io.storage import Storage

    try:
        table = read_manifest_table(Storage(str(out)))
    except (OSError, ValueError):
        table = None
    done: set[str] = set()
    if table is not None:
        columns = table[1]
        done = {columns.id_of(i) for i in range(len(columns.status)) if columns.status[i] == COMMITTED}
    records = out / "_commits"
    return done | ({p.stem for p in records.iterdir() if p.suffix == ".json"} if records.exists() else set())


def lease(out: Path) -> dict:
    try:
        return json.loads((out / "_lease.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for(what: Callable[[], bool], timeout_s: float = 180, every_s: float = 0.02) -> float:
    """Seconds until `what()` held; raises TimeoutError."""
    start = time.monotonic()
    while not what():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"waited {timeout_s:.0f} s")
        time.sleep(every_s)
    return time.monotonic() - start


def snapshot(out: Path) -> dict[str, tuple[int, int]]:
    """Every file under the output but the lease's own: (mtime_ns, size)."""
    return {str(p.relative_to(out)): (p.stat().st_mtime_ns, p.stat().st_size) for p in out.rglob("*")
            if p.is_file() and not p.name.startswith("_lease.json")}


def ids_once(out: Path, ids: list[str]) -> bool:
    got = [i for p in sorted((out / "parts").glob("part-*.parquet")) for i in pq.read_table(p).column("id").to_pylist()]
    return sorted(got) == sorted(ids)


def manifest_parts(out: Path) -> set[str]:
    manifest = json.loads((out / "_manifest.json").read_text())
    return {p for e in manifest["shards"].values() if e["status"] == "committed" for p in e.get("parts") or [e["part"]]}


def last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


# ---- scenarios --------------------------------------------------------------------------------------------
def sigstop_takeover(work: Path, address: str) -> tuple[bool, str]:
    job, ids = fake_job(work)
    out = work / "out"
    a = start_driver(job, address, work / "a.log")
    wait_for(lambda: len(committed(out)) >= 1)
    os.kill(a.pid, signal.SIGSTOP)
    a_commits, a_generation = len(committed(out)), lease(out).get("generation")
    b_start = time.monotonic()
    b = start_driver(job, address, work / "b.log")
    took_over_s = wait_for(lambda: lease(out).get("generation") != a_generation)
    b_rc = b.wait(timeout=300)
    b_wall = time.monotonic() - b_start
    after_b = snapshot(out)
    os.kill(a.pid, signal.SIGCONT)
    a_rc = a.wait(timeout=120)
    after_a = snapshot(out)
    changed = sorted(k for k in set(after_a) | set(after_b) if after_a.get(k) != after_b.get(k))
    parts = {str(p.relative_to(out)) for p in (out / "parts").glob("part-*")}
    same_parts = parts == manifest_parts(out)
    once = ids_once(out, ids)
    ok = b_rc == 0 and a_rc != 0 and not changed and same_parts and once
    return ok, (f"A stopped after {a_commits} commits; B took over after {took_over_s:.1f} s (generation "
                f"{a_generation}->{lease(out).get('generation')}) and finished rc={b_rc} in {b_wall:.1f} s; "
                f"A continued, exited rc={a_rc} ({last_line(work / 'a.log')!r}); files changed after SIGCONT: "
                f"{len(changed)} {changed[:3]}; parts == B's manifest: {same_parts} ({len(parts)}); ids once: {once}")


RACER = """
import json, sys, time
from jobrunner.io.lease import LeaseHeld, acquire_lease
from jobrunner.io.storage import Storage
url, opts, start_at, name = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
storage = Storage(url, opts or None)
storage.exists("_lease.json")  # connect before the start line
while time.time() < start_at:
    pass
try:
    lease = acquire_lease(storage, name, ttl_s=3.0, is_dead=lambda holder: False)
except LeaseHeld:
    print("REFUSED", flush=True)
else:
    print(f"WON {lease.generation}", flush=True)
    time.sleep(4.0)  # hold (renewing) while the others watch, then stall (no release)
    lease.stop_heartbeat()
"""


def _race_round(url: str, opts: dict | None, name: str) -> list[str]:
    start_at = time.time() + 2.0  # the racers import and connect first, then start on one instant
    procs = [subprocess.Popen([sys.executable, "-c", RACER, url, json.dumps(opts or {}), str(start_at),
                               f"{name}-{i}"], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for i in range(RACERS)]
    return [p.communicate(timeout=120)[0].strip() for p in procs]


def _race(url: str, opts: dict | None) -> tuple[bool, str]:
    """Two holders at once would both have won the same generation (each CAS from the version it read); a
    second, later generation in a round is a legitimate takeover of that round's winner after it stalled
    (a racer delayed past the winner's hold on a busy machine)."""
    rounds = []
    for r in range(4):  # round 0: no lease yet; then each round takes over the previous round's stalled winner
        results = _race_round(url, opts, f"round{r}")
        rounds.append(sorted(int(x.split()[1]) for x in results if x.startswith("WON")))
    ok = all(won and len(won) == len(set(won)) for won in rounds)
    return ok, (f"{RACERS} processes per round, 4 rounds (1 on an empty output, 3 taking over a stalled holder "
                f"at once): generations won per round {rounds} (the same generation twice = two holders)")


def race_local(work: Path, address: str) -> tuple[bool, str]:
    return _race(str(work / "out"), None)


def race_s3(work: Path, address: str) -> tuple[bool, str]:
    import s3fs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        opts = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
        s3fs.S3FileSystem(**opts).mkdir("lease-race")
        ok, detail = _race("s3://lease-race/out", opts)
        return ok, f"moto server 127.0.0.1:{port}: {detail}"
    finally:
        server.stop()


SKEW = "import time as _t; _real = _t.time; _t.time = lambda: _real() + {offset}"
OTHER_HOST = "import socket as _s; _s.gethostname = lambda: 'far-host'"


def skewed_clock(work: Path, address: str) -> tuple[bool, str]:
    (work / "behind").mkdir()
    job, ids = fake_job(work / "behind", num_rows=96)
    out = work / "behind" / "out"
    a = start_driver(job, address, work / "a.log", SKEW.format(offset=-3 * 3600))
    wait_for(lambda: bool(lease(out)))
    b = start_driver(job, address, work / "b.log")
    b_rc, a_rc = b.wait(timeout=120), a.wait(timeout=300)
    refused = b_rc != 0 and "which is alive" in (work / "b.log").read_text()
    live_ok = refused and a_rc == 0 and ids_once(out, ids)
    (work / "ahead").mkdir()
    job, ids = fake_job(work / "ahead")
    out = work / "ahead" / "out"
    c = start_driver(job, address, work / "c.log", SKEW.format(offset=3 * 3600) + "\n" + OTHER_HOST)
    wait_for(lambda: len(committed(out)) >= 1)
    c.send_signal(signal.SIGKILL)
    c.wait()
    generation = lease(out).get("generation")
    d = start_driver(job, address, work / "d.log")
    took_over_s = wait_for(lambda: lease(out).get("generation") != generation)
    d_rc = d.wait(timeout=300)
    dead_ok = d_rc == 0 and ids_once(out, ids) and took_over_s < 3600
    return live_ok and dead_ok, (
        f"holder 3 h behind, alive: second run refused={refused} ({last_line(work / 'b.log')!r}), holder "
        f"finished rc={a_rc}; holder 3 h ahead on 'far-host', killed: taken over after {took_over_s:.1f} s "
        f"(ttl {TTL_S:.0f} s), rerun rc={d_rc}, ids once: {ids_once(out, ids)}")


def kill9_rerun(work: Path, address: str) -> tuple[bool, str]:
    job, ids = fake_job(work)
    out = work / "out"
    a = start_driver(job, address, work / "a.log")
    wait_for(lambda: len(committed(out)) >= 2)
    os.kill(a.pid, signal.SIGKILL)
    a.wait()
    before, generation = committed(out), lease(out).get("generation")
    b = start_driver(job, address, work / "b.log")  # the same command at once (a cron / Airflow retry)
    took_over_s = wait_for(lambda: lease(out).get("generation") != generation)
    first_commit_s = wait_for(lambda: bool(committed(out) - before) or b.poll() is not None)
    rc = b.wait(timeout=300)
    once = ids_once(out, ids)
    ok = rc == 0 and once and took_over_s <= 10 and first_commit_s <= 10
    return ok, (f"killed after {len(before)} commits; same command at once: lease taken over after "
                f"{took_over_s:.2f} s, first new commit after {first_commit_s:.1f} s; rc={rc}; ids once: {once}")


def failed_then_fixed(work: Path, address: str) -> tuple[bool, str]:
    sys.path.insert(0, str(REPO))
    from tests.conftest import make_tiny_llama, make_tiny_tokenizer

    model_dir = work / "tiny-llama"
    tokenizer = make_tiny_tokenizer()
    make_tiny_llama(len(tokenizer), tokenizer.eos_token_id).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    ids = write_input(work / "in.parquet", 16)
    spec = {"name": "lease-scenario-real", "model": {"source": f"file://{work}/tiny-llamma", "dtype": "float32"},
            "input": {"url": str(work / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": 8},
            "sampling": {"max_tokens": 4, "temperature": 0.0}, "engine": {"max_num_seqs": 8, "num_kv_blocks": 64},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1},
            "output": {"url": str(work / "out"), "lease_ttl_s": TTL_S}}
    (work / "bad.yaml").write_text(yaml.safe_dump(spec))
    bad = start_driver(work / "bad.yaml", address, work / "bad.log")
    bad_rc = bad.wait(timeout=300)
    nothing = not committed(work / "out")
    spec["model"]["source"] = f"file://{model_dir}"
    (work / "good.yaml").write_text(yaml.safe_dump(spec))
    good = start_driver(work / "good.yaml", address, work / "good.log")
    good_rc = good.wait(timeout=300)
    once = ids_once(work / "out", ids)
    ok = bad_rc != 0 and nothing and good_rc == 0 and once
    return ok, (f"typo'd model source: rc={bad_rc}, committed nothing: {nothing} ({last_line(work / 'bad.log')!r}); "
                f"corrected source, same output: rc={good_rc}, ids once: {once}")


def _dashboard_head():
    """A Ray head with the Job Submission API on 127.0.0.1 (every port free) and its dashboard URL."""
    from ray.cluster_utils import Cluster

    sys.path.insert(0, str(REPO))
    from tests.driver.helpers import free_ports

    port, agent_http, agent_grpc, metrics, runtime_env = free_ports(5)
    head = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port,
        "dashboard_agent_listen_port": agent_http, "metrics_agent_port": agent_grpc, "metrics_export_port": metrics,
        "runtime_env_agent_port": runtime_env})
    return head, f"http://127.0.0.1:{port}"


def ray_job_ended(work: Path, address: str) -> tuple[bool, str]:
    from ray.job_submission import JobSubmissionClient

    job, ids = fake_job(work, step_delay_s=0.2)
    spec = yaml.safe_load(job.read_text())
    spec["output"]["lease_ttl_s"] = 600.0  # waiting it out would take 10 minutes
    job.write_text(yaml.safe_dump(spec))
    out = work / "out"
    head, dashboard = _dashboard_head()
    try:
        submit = subprocess.run([sys.executable, "-m", "jobrunner.cli", "submit", str(job), "--address", dashboard],
                                cwd=REPO, capture_output=True, text=True, timeout=300)
        ray_job = next(w for w in submit.stdout.split() if w.startswith("raysubmit_"))
        wait_for(lambda: len(committed(out)) >= 2, timeout_s=300)
        holder = lease(out)
        client = JobSubmissionClient(dashboard)
        client.stop_job(ray_job)
        wait_for(lambda: str(client.get_job_status(ray_job)).endswith("STOPPED"), timeout_s=60)
        before = committed(out)
        started = time.monotonic()
        other_host = "import jobrunner.driver.ray_holder as h; h.holder_is_dead_here = lambda holder: False"
        b = start_driver(job, address, work / "b.log", prelude=other_host)
        took_over_s = wait_for(lambda: lease(out).get("generation") != holder.get("generation"), timeout_s=120)
        rc = b.wait(timeout=300)
    finally:
        head.shutdown()
    once = ids_once(out, ids)
    recorded = holder.get("ray", {})
    ok = rc == 0 and once and took_over_s < 60 and recorded.get("submission_id") == ray_job
    return ok, (f"Ray job {ray_job} (lease records {sorted(recorded)}) stopped after {len(before)} commits; `run` "
                f"as from another host took the lease over after {took_over_s:.1f} s (ttl 600 s, started "
                f"{time.monotonic() - started:.0f} s ago at the end); rc={rc}; ids once: {once}")


def rewritten_file(work: Path, address: str) -> tuple[bool, str]:
    job, ids = fake_job(work, step_delay_s=0.2)
    out, original = work / "out", (work / "in.parquet").read_bytes()
    a = start_driver(job, address, work / "a.log")
    wait_for(lambda: len(committed(out)) >= 1)
    write_input(work / "in.parquet", 168)  # rewritten: 8 more rows
    a_rc = a.wait(timeout=300)
    a_says = next((line for line in (work / "a.log").read_text(errors="replace").splitlines()
                   if "changed after the job was planned" in line), "")
    b = start_driver(job, address, work / "b.log")
    b_rc = b.wait(timeout=300)
    b_log = (work / "b.log").read_text(errors="replace")
    b_says = next((line for line in b_log.splitlines() if "the input changed since the earlier run" in line), "")
    (work / "in.parquet").write_bytes(original)  # put back
    c = start_driver(job, address, work / "c.log")
    c_rc = c.wait(timeout=300)
    once = ids_once(out, ids)
    ok = a_rc != 0 and bool(a_says) and b_rc != 0 and "in.parquet changed (" in b_says and c_rc == 0 and once
    b_says = b_says[b_says.index("input file"):] if "input file" in b_says else b_says
    return ok, (f"running job: rc={a_rc}, {a_says.strip()[:230]!r}; rerun: rc={b_rc}, {b_says[:200]!r}; "
                f"original back: rc={c_rc}, ids once: {once}")


SCENARIOS = {"sigstop_takeover": sigstop_takeover, "race_local": race_local, "race_s3": race_s3,
             "skewed_clock": skewed_clock, "kill9_rerun": kill9_rerun, "failed_then_fixed": failed_then_fixed,
             "ray_job_ended": ray_job_ended, "rewritten_file": rewritten_file}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # workers import the double
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    failures = 0
    try:
        with tempfile.TemporaryDirectory(prefix="lease-scenarios-") as tmp:
            for name in args.only:
                work = Path(tmp) / name
                work.mkdir()
                started = time.monotonic()
                try:
                    ok, detail = SCENARIOS[name](work, cluster.address)
                except Exception as exc:  # noqa: BLE001 - report and go on to the next scenario
                    ok, detail = False, f"error: {type(exc).__name__}: {exc}"
                failures += not ok
                print(f"{name:<18} {'PASS' if ok else 'FAIL'}  {detail}  [{time.monotonic() - started:.0f} s]",
                      flush=True)
    finally:
        cluster.shutdown()
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
