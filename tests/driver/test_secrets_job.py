"""A whole job with a secret planted in every place one can hide (model source credentials and query, input and
output storage_options, factory_options, engine error texts in quoted pairs, a presigned input URL), on a local
Ray and the real S3 test server: no file under the output, no Ray log of the session, no driver log line and
nothing printed holds any of them, while the redaction marker shows where they were."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.storage import Storage
from jobrunner.redaction import REDACTED
from jobrunner.reports import write_job_report
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import new_bucket

pytestmark = pytest.mark.timeout(600)

KEY = "JRplantedFactoryKey"  # letters only: error kinds fold digits to N, which would hide a leak
SECRETS = {"factory api_key": KEY, "model source password": "JRplantedSourcePw",
           "model source query": "JRplantedSourceQuery", "input header": "JRplantedInputHeader",
           "input session token": "JRplantedSessionToken", "output token": "JRplantedOutputToken"}
PROMPTS = ["hello there", "ROWERR please", "REJECT this", "CRASH now", "fine too", "last one"]


def _batch_lines() -> bytes:
    return "\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"messages": [{"role": "user", "content": p}], "max_tokens": 3}})
                     for i, p in enumerate(PROMPTS)).encode()


def _presigned_input(s3_server, bucket: str) -> tuple[str, str]:
    """Upload the batch file; a presigned GET URL (SigV4, with a session token) and its signature."""
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], aws_access_key_id="testing",
                          aws_secret_access_key="testing", aws_session_token=SECRETS["input session token"],
                          region_name="us-east-1", config=Config(signature_version="s3v4"))
    client.put_object(Bucket=bucket, Key="in/batch.jsonl", Body=_batch_lines())
    url = client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "in/batch.jsonl"})
    return url, url.split("X-Amz-Signature=")[1].split("&")[0]


def _output_files(opts: dict, root: str) -> dict[str, str]:
    import s3fs

    fs = s3fs.S3FileSystem(**{k: v for k, v in opts.items() if k != "token"})
    return {p: fs.cat_file(p).decode("utf-8", "replace") for p in fs.find(root)}


def _log_files() -> dict[str, str]:
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return {str(p): p.read_bytes().decode("utf-8", "replace") for p in logs.rglob("*") if p.is_file()}


def _driver_log(caplog) -> str:
    """Every record the job's process logged, less the test S3 server's own access log (werkzeug, in this
    process: it prints the presigned URL the test itself sends, which no jobrunner code wrote)."""
    return "\n".join(f"{r.name} {r.getMessage()}" for r in caplog.records if not r.name.startswith("werkzeug"))


def test_no_planted_secret_leaves_the_job(local_ray, s3_server, capfd, caplog):
    bucket = new_bucket(s3_server)
    url, signature = _presigned_input(s3_server, bucket)
    secrets = {**SECRETS, "input signature": signature}
    out_opts = {**s3_server["storage_options"], "token": SECRETS["output token"]}
    data = {"name": "secret-job",
            "model": {"source": f"https://jr:{SECRETS['model source password']}@models.example.com/m"
                                f"?token={SECRETS['model source query']}"},
            "input": {"url": url, "format": "openai_batch", "rows_per_shard": 2,
                      "storage_options": {"headers": {"X-Api-Key": SECRETS["input header"]}}},
            "sampling": {"max_tokens": 3},
            "engine": {"factory": "tests.driver.secret_engine:make_engine", "factory_options": {"api_key": KEY}},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
            "output": {"url": f"s3://{bucket}/out", "storage_options": out_opts, "max_error_rate": 1.0}}
    with caplog.at_level(logging.INFO):
        result = run_job(spec_from_dict(data), show_progress=False)
        report = write_job_report(f"s3://{bucket}/out", out_opts)
    assert "error" not in report, report
    printed = capfd.readouterr()
    places = {**_output_files(out_opts, f"{bucket}/out"), **_log_files(),
              "driver log": _driver_log(caplog), "stdout": printed.out, "stderr": printed.err,
              "summary": result.summary(), "failure message": result.failure_message()}
    hits = [(place, name) for place, text in places.items() for name, secret in secrets.items() if secret in text]
    assert hits == []
    # the marker shows where each secret was, so the search above looked at the right texts
    manifest = json.loads(places[f"{bucket}/out/_manifest.json"])
    assert manifest["model"]["source"] == "https://***@models.example.com/m?token=***"
    shards = read_manifest_with_records(Storage(f"s3://{bucket}/out", out_opts))["shards"]  # the shard table
    assert REDACTED in next(iter(shards.values()))["file"]
    kinds = " ".join(manifest["totals"]["error_kinds"])
    assert '{"api_key": "***"}' in kinds and "'token': '***'" in kinds
    openai_out = places[f"{bucket}/out/_openai/output.jsonl"]
    assert '"model": "https://***@models.example.com/m?token=***"' in openai_out.replace('":"', '": "')
    errors = places[f"{bucket}/out/_openai/errors.jsonl"]
    assert "sent Authorization: ***" in errors and "'token': '***'" in errors
    assert '\\"password\\":\\"***\\"' in errors
    assert manifest["spec"]["engine"]["factory_options"] == {"api_key": REDACTED}
