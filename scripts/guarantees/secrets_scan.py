"""Secrets scan and overwrite refusals (issue 15, items 10 and 11), measured on real runs.

Plants a distinct secret in every place one can hide — model source credentials and query, input
storage_options (a header), a presigned input URL (session token, access key id, signature), output
storage_options (key, secret, token), engine.factory_options (api_key) and engine error texts that quote it in
quoted pairs and a bearer header — then runs:

  A. `jobrunner run` against a local Ray head (started here with its own --temp-dir), input on a local S3
     server (moto) through the presigned URL, output on that server; then `jobrunner report` on the output;
  B. `jobrunner submit --wait` of the same job written with ${env:NAME} references, resolved on the head.

It then searches every object under both outputs, every file of the Ray session (driver, worker, raylet, GCS,
dashboard and job logs), the captured stdout/stderr of every command, the Ray job's info (runtime_env,
entrypoint) and its logs, and prints each place checked and the hits (must be zero). Last, it tries
`output.mode=overwrite` on folders it must refuse and prints each refusal.

Usage (from the checkout; about 3 minutes on 2 cores):
  PYTHONPATH=. .venv/bin/python scripts/guarantees/secrets_scan.py [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.driver.helpers import free_ports  # noqa: E402 - the repo on the path first

PY = sys.executable
FACTORY = "tests.driver.secret_engine:make_engine"
# Letters only (error kinds fold digits to N, which would hide a leak from a plain search); all distinct.
SECRETS = {
    "model source password": "JRSCANsourcePassword", "model source query token": "JRSCANsourceQueryToken",
    "input storage_options header": "JRSCANinputHeaderValue", "input presigned session token": "JRSCANstsSessionToken",
    "input presigned access key id": "AKIAJRSCANINPUTKEYX", "output storage_options key": "AKIAJRSCANOUTPUTKEY",
    "output storage_options secret": "JRSCANoutputSecretKey", "output storage_options token": "JRSCANoutputSessionTok",
    "factory_options api_key (and the engine error texts quoting it)": "JRSCANfactoryApiKey",
}
ENV_OF = {"model source password": "JR_SCAN_MODEL_SOURCE", "input storage_options header": "JR_SCAN_INPUT_HEADER",
          "output storage_options key": "JR_SCAN_OUT_KEY", "output storage_options secret": "JR_SCAN_OUT_SECRET",
          "output storage_options token": "JR_SCAN_OUT_TOKEN",
          "factory_options api_key (and the engine error texts quoting it)": "JR_SCAN_FACTORY_KEY"}
PROMPTS = ["hello there", "ROWERR please", "REJECT this", "CRASH now", "fine too", "last one", "and more", "done"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (outputs, logs)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jrs-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log is noise here

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    endpoint = "http://{}:{}".format(*moto.get_host_and_port())
    head = None
    try:
        secrets = dict(SECRETS)
        bucket = _bucket(endpoint)
        url_a, secrets["input presigned signature (run A)"] = _presigned(endpoint, bucket)
        url_b, secrets["input presigned signature (run B)"] = _presigned(endpoint, bucket)
        env = _head_env(work, endpoint, url_b)
        head, gcs, dashboard = _start_head(work, env)
        places = _run_jobs(work, endpoint, bucket, url_a, gcs, dashboard)
        places.update(_outputs(endpoint, bucket))
        places.update(_ray_session_files(work / "ray"))
        places["ray start --head (its stdout/stderr)"] = {"head.log": (work / "head.log").read_text("utf-8", "replace")}
        hits = _search(places, secrets)
        try:
            _show_markers(places, bucket)
        except (KeyError, IndexError, StopIteration, ValueError) as exc:
            print(f"\n(run A left no output to show: {type(exc).__name__}: {exc})")
        _overwrite_refusals(work, gcs)
        print(f"\nsecrets planted: {len(secrets)}; places checked: {len(places)}; "
              f"files/texts searched: {sum(len(v) for v in places.values())}; hits: {len(hits)}")
        return 1 if hits else 0
    finally:
        if head is not None:
            _stop(head)
        moto.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# ---- setup ------------------------------------------------------------------------------------------------

def _s3_client(endpoint: str, **credentials):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(signature_version="s3v4"),
                        **({"aws_access_key_id": "testing", "aws_secret_access_key": "testing"} | credentials))


def _bucket(endpoint: str) -> str:
    bucket = f"jr-scan-{os.getpid()}"
    client = _s3_client(endpoint)
    client.create_bucket(Bucket=bucket)
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"messages": [{"role": "user", "content": p}], "max_tokens": 3}})
             for i, p in enumerate(PROMPTS)]
    client.put_object(Bucket=bucket, Key="in/batch.jsonl", Body="\n".join(lines).encode())
    return bucket


def _presigned(endpoint: str, bucket: str) -> tuple[str, str]:
    """A presigned GET URL of the batch file (SigV4 with a session token) and its signature."""
    client = _s3_client(endpoint, aws_access_key_id=SECRETS["input presigned access key id"],
                        aws_session_token=SECRETS["input presigned session token"])
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "in/batch.jsonl"})
    time.sleep(1.1)  # the next URL is signed at another second: another signature
    return url, url.split("X-Amz-Signature=")[1].split("&")[0]


def _source(password: str) -> str:
    return f"https://jr-user:{password}@models.example.com/llama?token={SECRETS['model source query token']}"


def _head_env(work: Path, endpoint: str, url_b: str) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work), "PYTHONPATH": str(REPO),
           "RAY_USAGE_STATS_ENABLED": "0", "JR_SCAN_INPUT_URL": url_b, "JR_SCAN_ENDPOINT": endpoint}
    for name, var in ENV_OF.items():
        env[var] = _source(SECRETS[name]) if var == "JR_SCAN_MODEL_SOURCE" else SECRETS[name]
    return env


def _start_head(work: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int, int]:
    gcs, dashboard, client, agent_grpc, agent_http, metrics, runtime_env = free_ports(7)
    command = [str(Path(PY).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--port={gcs}", "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
               f"--dashboard-agent-grpc-port={agent_grpc}", f"--dashboard-agent-listen-port={agent_http}",
               f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
               f"--temp-dir={work / 'ray'}", "--disable-usage-stats"]
    head = subprocess.Popen(command, env=env, cwd=work, start_new_session=True,
                            stdout=open(work / "head.log", "w"), stderr=subprocess.STDOUT)
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + 180
    while True:
        try:
            JobSubmissionClient(f"http://127.0.0.1:{dashboard}").list_jobs()
            return head, gcs, dashboard
        except Exception:  # noqa: BLE001 - not up yet
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray head did not start:\n{(work / 'head.log').read_text()[-3000:]}") from None
            time.sleep(1.0)


def _stop(head: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(head.pid, sig)
            head.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


# ---- the runs ---------------------------------------------------------------------------------------------

def _spec(name: str, input_url: str, output_url: str, endpoint: str, literal: bool) -> dict:
    """The job with every secret planted: literal values (run) or ${env:NAME} references (submit)."""
    def value(name: str) -> str:
        return SECRETS[name] if literal else f"${{env:{ENV_OF[name]}}}"

    return {
        "name": name,
        "model": {"source": _source(SECRETS["model source password"]) if literal else "${env:JR_SCAN_MODEL_SOURCE}"},
        "input": {"url": input_url, "format": "openai_batch", "rows_per_shard": 2,
                  "storage_options": {"headers": {"X-Api-Key": value("input storage_options header")}}},
        "sampling": {"max_tokens": 3},
        "engine": {"factory": FACTORY, "max_num_seqs": 4,
                   "factory_options": {"api_key": value("factory_options api_key (and the engine error texts "
                                                        "quoting it)")}},
        "cluster": {"num_workers": 2, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
        "output": {"url": output_url, "mode": "overwrite", "max_error_rate": 1.0,
                   "storage_options": {"key": value("output storage_options key"),
                                       "secret": value("output storage_options secret"),
                                       "token": value("output storage_options token"),
                                       "endpoint_url": endpoint}},
    }


def _command(work: Path, label: str, args: list[str], env: dict[str, str] | None = None) -> dict[str, str]:
    """Run `python -m jobrunner.cli ARGS`, print its exit code; its stdout and stderr as places to search."""
    started = time.monotonic()
    done = subprocess.run([PY, "-m", "jobrunner.cli", *args], cwd=work, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=600)
    print(f"{label}: exit {done.returncode} in {time.monotonic() - started:.0f}s")
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    print(f"  last line: {tail[:200]}")
    return {f"{label} stdout": done.stdout, f"{label} stderr": done.stderr}


def _run_jobs(work: Path, endpoint: str, bucket: str, url_a: str, gcs: int, dashboard: int) -> dict[str, dict]:
    places: dict[str, dict] = {}
    spec_a = work / "job-a.yaml"
    spec_a.write_text(yaml.safe_dump(_spec("scan-a", url_a, f"s3://{bucket}/out-a", endpoint, literal=True)))
    places["run A: captured driver output"] = _command(work, "A jobrunner run", [
        "run", str(spec_a), "--address", f"127.0.0.1:{gcs}"])
    options = json.dumps({"key": SECRETS["output storage_options key"],
                          "secret": SECRETS["output storage_options secret"], "endpoint_url": endpoint})
    places["jobrunner report (stdout/stderr)"] = _command(work, "jobrunner report", [
        "report", f"s3://{bucket}/out-a", "--storage-options", options])
    spec_b = work / "job-b.yaml"
    spec_b.write_text(yaml.safe_dump(_spec("scan-b", "${env:JR_SCAN_INPUT_URL}", f"s3://{bucket}/out-b",
                                           endpoint, literal=False)))
    submitted = _command(work, "B jobrunner submit --wait", [
        "submit", str(spec_b), "--address", f"http://127.0.0.1:{dashboard}", "--wait"])
    places["run B: captured submit output (the job's logs)"] = submitted
    places["run B: Ray job info and logs (API)"] = _ray_job(dashboard, submitted)
    return places


def _ray_job(dashboard: int, submitted: dict[str, str]) -> dict[str, str]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(f"http://127.0.0.1:{dashboard}")
    lines = next(iter(submitted.values())).splitlines()
    if not lines:
        print("  (no Ray job id printed: nothing to ask the API)")
        return {}
    job_id = lines[0].strip()
    info = client.get_job_info(job_id)
    return {"runtime_env": json.dumps(info.runtime_env), "entrypoint": info.entrypoint,
            "metadata": json.dumps(info.metadata), "message": str(info.message),
            "logs": client.get_job_logs(job_id), "list_jobs": str(client.list_jobs())}


# ---- the search -------------------------------------------------------------------------------------------

def _outputs(endpoint: str, bucket: str) -> dict[str, dict]:
    import s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint)
    fs.invalidate_cache()
    return {f"output {run} (every object under s3://{bucket}/{run})":
            {p: fs.cat_file(p).decode("utf-8", "replace") for p in fs.find(f"{bucket}/{run}")}
            for run in ("out-a", "out-b")}


def _ray_session_files(ray_dir: Path) -> dict[str, dict]:
    files = {}
    for path in sorted(ray_dir.rglob("*")):
        if path.is_file() and not path.is_symlink() and not path.is_socket():
            files[str(path.relative_to(ray_dir))] = path.read_bytes().decode("utf-8", "replace")
    logs = {k: v for k, v in files.items() if "/logs/" in k}
    rest = {k: v for k, v in files.items() if "/logs/" not in k}
    return {f"Ray session logs ({ray_dir}/session_*/logs: driver, workers, raylet, GCS, dashboard, jobs)": logs,
            f"Ray session, other files ({ray_dir}, runtime_resources, config)": rest}


def _search(places: dict[str, dict], secrets: dict[str, str]) -> list[tuple[str, str, str]]:
    print("\n== secrets search ==")
    hits = []
    for place, texts in places.items():
        found = [(name, where) for where, text in texts.items() for name, secret in secrets.items()
                 if secret in text]
        size = sum(len(t) for t in texts.values())
        print(f"{place}: {len(texts)} file(s)/text(s), {size} chars: {len(found)} hit(s)")
        for name, where in found:
            text = texts[where]
            at = text.index(secrets[name])
            print(f"  HIT {name} in {where}: ...{text[max(0, at - 80):at + 40]!r}...")
            hits.append((place, where, name))
    return hits


def _show_markers(places: dict[str, dict], bucket: str) -> None:
    """Where the secrets were, as the outputs show them now (the search read the right texts)."""
    out = next(v for k, v in places.items() if k.startswith("output out-a"))
    manifest = json.loads(out[f"{bucket}/out-a/_manifest.json"])
    shard = next(iter(manifest["shards"].values()))
    print("\n== what the output shows instead ==")
    print(f"manifest model.source: {manifest['model']['source']}")
    print(f"manifest spec.engine.factory_options: {manifest['spec']['engine']['factory_options']}")
    print(f"manifest spec.output.storage_options: {manifest['spec']['output']['storage_options']}")
    print(f"manifest shard file: {shard['file']}")
    for kind, count in manifest["totals"]["error_kinds"].items():
        print(f"manifest error kind ({count}): {kind}")
    first = out[f"{bucket}/out-a/_openai/output.jsonl"].splitlines()[0]
    print(f"OpenAI output model: {json.loads(first)['response']['body']['model']}")


# ---- overwrite refusals -----------------------------------------------------------------------------------

def _overwrite_refusals(work: Path, gcs: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    print("\n== overwrite refusals (jobrunner run, output.mode=overwrite) ==")
    root = work / "ow"
    (root / "data").mkdir(parents=True)
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(8)], "prompt": [f"q {i}" for i in range(8)]}),
                   root / "data" / "in.parquet")

    def spec(name: str, input_url: Path, output: Path) -> Path:
        data = {"name": name, "input": {"url": str(input_url), "prompt_column": "prompt", "id_column": "id",
                                        "rows_per_shard": 4},
                "engine": {"factory": "tests.driver.fake_engine:make_engine"}, "sampling": {"max_tokens": 2},
                "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5},
                "output": {"url": str(output), "mode": "overwrite"}}
        path = root / f"{name}-{output.name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    def case(label: str, name: str, output: Path, input_url: Path = root / "data" / "in.parquet") -> None:
        before = sorted(str(p) for p in output.rglob("*")) if output.exists() else []
        done = subprocess.run([PY, "-m", "jobrunner.cli", "run", str(spec(name, input_url, output)), "--no-progress",
                               "--no-report", "--address", f"127.0.0.1:{gcs}"], cwd=work, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
        after = sorted(str(p) for p in output.rglob("*")) if output.exists() else []
        said = (done.stderr.strip().splitlines() or [""])[-1] if done.returncode else \
            (done.stdout.strip().splitlines() or [""])[-1]
        kept = "folder untouched" if before == after else f"folder changed: {sorted(set(after) ^ set(before))}"
        print(f"- {label}: exit {done.returncode}; {kept if done.returncode else 'ran'}\n    {said}")

    (root / "empty").mkdir()
    case("empty folder (accepted)", "ow-job", root / "empty")
    case("earlier output of the same job (accepted)", "ow-job", root / "empty")
    case("the output of another job", "ow-other", root / "empty")
    for name in ("_archive", "_raw"):
        (root / "underscored" / name).mkdir(parents=True)
        (root / "underscored" / name / "old.parquet").write_bytes(b"keep")
    case("a folder holding only _archive/ and _raw/", "ow-job", root / "underscored")
    for name in ("notes.txt", "a.csv", "b.csv"):
        (root / "underscored" / name).write_text("keep")
    case("_archive/, _raw/ and 3 files", "ow-job", root / "underscored")
    shutil.copytree(root / "empty", root / "stray")
    (root / "stray" / "parts" / "README.md").write_text("keep")
    case("a job output with a stray file in parts/", "ow-job", root / "stray")
    os.symlink(root / "data", root / "link-to-data")
    case("output is a symlink to the input's folder", "ow-job", root / "link-to-data")
    (root / "linked-in").mkdir()
    (root / "out-real").mkdir()
    shutil.copy(root / "data" / "in.parquet", root / "out-real" / "real.parquet")
    os.symlink(root / "out-real" / "real.parquet", root / "linked-in" / "link.parquet")
    case("input folder holds a symlink to a file in the output", "ow-job", root / "out-real", root / "linked-in")
    case("output inside the input folder", "ow-job", root / "data" / "results", root / "data")


if __name__ == "__main__":
    sys.exit(main())
