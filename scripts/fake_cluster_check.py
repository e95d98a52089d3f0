"""Exercise cluster.yaml's node types on Ray's local `fake_multinode` provider: a head with the file's
resources (CPU: 0, so no worker fits there), its `gpu_worker` type with a fake GPU each, and a jobrunner job
submitted through the Job API that asks for one GPU per worker — the autoscaler must start gpu_worker nodes.

What it cannot exercise (the fake provider ignores them): the AMI, `file_mounts`, setup commands and
`node_config`; those are covered by tests/test_cluster_config.py (Ray's schema, pins, the wheel).

    PYTHONPATH=. .venv/bin/python scripts/fake_cluster_check.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import free_ports  # noqa: E402 - the repo on the path first


def fake_config(gcs_port: int) -> dict:
    """cluster.yaml with the provider swapped for fake_multinode and fake resources on the GPU type."""
    config = yaml.safe_load((REPO / "cluster.yaml").read_text())
    head = config["available_node_types"].pop(config["head_node_type"])
    worker_name, worker = next(iter(config["available_node_types"].items()))
    return {
        "cluster_name": config["cluster_name"], "max_workers": min(config["max_workers"], 2),
        "upscaling_speed": config["upscaling_speed"], "idle_timeout_minutes": 1,
        "provider": {"type": "fake_multinode", "gcs_address": f"127.0.0.1:{gcs_port}", "launch_multiple": True},
        "auth": config["auth"],
        "available_node_types": {
            "ray.head.default": {"resources": head["resources"], "node_config": {}, "max_workers": 0},
            worker_name: {"resources": {"CPU": 1, "GPU": 1}, "node_config": {},
                          "min_workers": worker["min_workers"], "max_workers": 2},
        },
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", default=None, help="Keep the work folder (config, logs, output) here.")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix="jr-fake-"))
    work.mkdir(parents=True, exist_ok=True)
    gcs, dashboard, client, metrics = free_ports(4)
    (work / "fake.yaml").write_text(yaml.safe_dump(fake_config(gcs)))
    temp_dir = tempfile.mkdtemp(prefix="jr-fk-")
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ray_bin = str(Path(sys.executable).parent / "ray")
    head = subprocess.Popen(
        [ray_bin, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}", "--num-cpus=0",
         f"--dashboard-port={dashboard}", "--dashboard-host=127.0.0.1", f"--ray-client-server-port={client}",
         f"--metrics-export-port={metrics}", f"--temp-dir={temp_dir}",
         f"--autoscaling-config={work / 'fake.yaml'}", "--disable-usage-stats"],
        env=env, cwd=work, start_new_session=True, stdout=open(work / "head.log", "w"), stderr=subprocess.STDOUT)
    try:
        return run_job(work, f"http://127.0.0.1:{dashboard}", f"127.0.0.1:{gcs}", env, temp_dir)
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2)
        _kill_group(head.pid)  # the fake nodes (raylets the monitor started) share its process group
        shutil.rmtree(temp_dir, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_job(work: Path, url: str, gcs: str, env: dict, temp_dir: str) -> int:
    from ray.job_submission import JobSubmissionClient

    from jobrunner.driver.submit import find_auth_token
    from tests.driver.helpers import fake_spec, write_prompts

    token = find_auth_token()  # RAY_AUTH_MODE=token heads need it (submit finds it the same way)
    headers = {"Authorization": f"Bearer {token}"} if token else None

    deadline = time.monotonic() + 180
    while True:
        try:
            JobSubmissionClient(url, headers=headers).list_jobs()
            break
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                print((work / "head.log").read_text()[-3000:])
                return 2
            time.sleep(2)
    write_prompts(work / "in.parquet", 32)
    spec = fake_spec(str(work / "in.parquet"), str(work / "out"),
                     cluster={"num_workers": 2, "num_gpus_per_worker": 1, "num_cpus_per_worker": 0.5})
    (work / "job.yaml").write_text(yaml.safe_dump(spec))
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "jobrunner.cli", "submit", str(work / "job.yaml"), "--address",
                             url, "--follow"], env=env, cwd=work, capture_output=True, text=True, timeout=900,
                            check=False)
    print(result.stdout[-4000:], result.stderr[-2000:], sep="\n")
    print(f"submit --follow exit {result.returncode} after {time.monotonic() - started:.0f} s")
    nodes = subprocess.run([str(Path(sys.executable).parent / "ray"), "list", "nodes", f"--address={gcs}",
                            "--format=yaml"], env=env, capture_output=True, text=True, timeout=120, check=False)
    listed = yaml.safe_load(nodes.stdout) if nodes.returncode == 0 else None
    for node in listed or []:
        print(f"node {node.get('node_name')} head={node.get('is_head_node')} state={node.get('state')} "
              f"resources={node.get('resources_total')} labels={node.get('labels', {}).get('ray.io/node-group')}")
    if listed is None:
        print(nodes.stdout[-2000:], nodes.stderr[-2000:])
    monitor = sorted(Path(temp_dir).glob("session_*/logs/monitor.log"))
    if monitor:
        launched = [line for line in monitor[-1].read_text().splitlines() if "gpu_worker" in line]
        print("monitor.log lines naming gpu_worker:", len(launched), *launched[-5:], sep="\n  ")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
