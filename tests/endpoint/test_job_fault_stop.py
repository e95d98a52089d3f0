"""The driver's side of a misconfigured endpoint, through a real run on Ray against the tiny local server
(tests/endpoint/tiny_server.py): a wrong key ends the run with the fix named, no error row and no shard charged,
the shards left pending; the rerun with the right key finishes every row, and its report (priced per token)
notes no missing worker-hour price (a wrong model and no server alike: heavy)."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.reports.job import load_report
from jobrunner.spec import load_spec
from tests.driver.helpers import REPO, read_manifest_file
from tests.endpoint.tiny_server import MODEL, TinyServer, closed_port_url

pytestmark = pytest.mark.timeout(300)
KEY = "sk-tiny-job-key-5e6f7a8b9c"


def _spec(tmp_path, url: str, key: str, model: str = MODEL):
    """example.yaml on the endpoint, priced per token only (no worker-hour price, as an endpoint user has)."""
    example = (REPO / "jobs" / "example.yaml").read_text()
    assert "cost: {worker_hour_usd: 0.10}" in example
    (tmp_path / "job.yaml").write_text(example.replace(
        "cost: {worker_hour_usd: 0.10}", "cost: {usd_per_m_input: 1.0, usd_per_m_output: 2.0}"))
    return load_spec(tmp_path / "job.yaml", [
        f"input.url={tmp_path / 'rows.parquet'}", "input.rows_per_shard=4", "sampling.max_tokens=4",
        f"output.url={tmp_path / 'out'}", "cluster.num_cpus_per_worker=0.5", "engine.backend=openai",
        f"engine.endpoint.base_url={url}", f"engine.endpoint.model={model}", f"engine.endpoint.api_key={key}",
        "engine.endpoint.max_concurrency=2", "engine.endpoint.max_retries=1"])


def test_a_wrong_key_stops_the_run_resumable_and_the_fixed_rerun_finishes(local_ray, tmp_path):
    rows = pq.read_table(REPO / "examples" / "data" / "prompts.parquet").slice(0, 8)
    pq.write_table(rows, tmp_path / "rows.parquet")
    out = tmp_path / "out"
    with TinyServer(KEY) as server:
        first = run_job(_spec(tmp_path, server.url, "sk-wrong"), show_progress=False)
        assert not first.ok
        assert first.error == (f"endpoint {server.url}: HTTP 401 on POST /chat/completions (Incorrect API key "
                               "provided): check engine.endpoint.api_key (or $OPENAI_API_KEY on the workers); "
                               "the run stops, resumable: run it again to go on")
        assert first.failure_message() == first.error  # the console's last line: no failed shard, no error rows
        assert not (out / "parts").exists() or not any((out / "parts").iterdir())
        manifest = read_manifest_file(out)
        assert manifest["runs"][0]["stopped"] == first.error and manifest["runs"][0]["status"] == "failed"
        assert [e["status"] for e in manifest["shards"].values()] == ["pending", "pending"]
        assert [e["failures"] for e in manifest["shards"].values()] == [0, 0]  # nothing charged

        second = run_job(_spec(tmp_path, server.url, KEY), show_progress=False)
        assert second.ok, second.summary()
    table = read_output(str(out)).to_pylist()
    assert sorted(r["id"] for r in table) == sorted(rows.column("id").to_pylist())
    assert all(r["error"] is None and r["generated_text"] == "ok" for r in table)
    assert read_manifest_file(out)["run_count"] == 2
    cost = load_report(str(out))["cost"]  # priced per token: no worker-hour price asked for, no split noted
    assert cost["token_priced"]["usd_per_m_input"] == 1.0 and cost["worker_hour_usd"] is None
    assert not [n for n in cost["notes"] if n.startswith(("no price", "no engine prefill/decode"))]
    assert [n.split(" (")[0] for n in cost["notes"]] == ["run 0", "run 1"]


@pytest.mark.heavy  # two more runs of the same driver path (the engine's own tests cover each reason)
def test_a_wrong_model_and_no_server_stop_the_run_alike(local_ray, tmp_path):
    rows = pq.read_table(REPO / "examples" / "data" / "prompts.parquet").slice(0, 4)
    pq.write_table(rows, tmp_path / "rows.parquet")
    with TinyServer(KEY) as server:
        wrong_model = run_job(_spec(tmp_path, server.url, KEY, model="gpt-4o"), show_progress=False)
    assert not wrong_model.ok and wrong_model.error.startswith(
        f"endpoint {server.url}: HTTP 404 on POST /chat/completions (The model `gpt-4o` does not exist.): "
        "engine.endpoint.model 'gpt-4o' is not served there; the server's models: tiny")
    url = closed_port_url()
    nobody = run_job(_spec(tmp_path, url, KEY), show_progress=False)
    assert not nobody.ok and nobody.error.startswith(f"endpoint {url}: no server answered after 2 attempts")
    manifest = read_manifest_file(tmp_path / "out")
    assert [e["status"] for e in manifest["shards"].values()] == ["pending"]
    assert [e["failures"] for e in manifest["shards"].values()] == [0]
