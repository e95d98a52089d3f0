"""Pipelines end to end (issue 48): generate -> judge -> rewrite on 64 rows with the fake engine (the judge is
tests/driver/judge_engine.py), the driver killed with SIGKILL in stage 2 and rerun; and once on our engine
with a tiny random model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import yaml

from jobrunner.driver.pipeline import run_pipeline
from jobrunner.io.manifest import read_manifest_with_records
from jobrunner.io.storage import Storage
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import REPO

pytestmark = pytest.mark.timeout(600)
N = 64
NULL_TOPIC, UNPARSEABLE, FILTER_ERROR = 5, 7, 16  # rows made to stop in the judge / the last filter


def _write_input(path: Path) -> list[str]:
    ids = [f"p{i:03d}" for i in range(N)]
    prompts = [("UNPARSEABLE " if i == UNPARSEABLE else "") + f"question {i} about things" for i in range(N)]
    topics = [None if i == NULL_TOPIC else f"t{i % 3}" for i in range(N)]
    pq.write_table(pa.table({"id": ids, "prompt": prompts, "topic": topics}), path, row_group_size=8)
    return ids


def _pipeline(input_url: str, output_url: str, step_delay_s: float, gate_file: str) -> dict:
    slow = {"factory_options": {"step_delay_s": step_delay_s}}
    # the generator stops after 2 shards (16 rows) until the gate file exists: the judge works meanwhile
    gated = {"factory": "tests.driver.judge_engine:make_gated",
             "factory_options": {"step_delay_s": step_delay_s, "gate_file": gate_file, "hold_after": 16}}
    return {"name": "judged", "input": {"url": input_url, "prompt_column": "prompt", "id_column": "id",
                                        "rows_per_shard": 8},
            "sampling": {"max_tokens": 4},
            "engine": {"max_num_seqs": 4, "factory": "tests.driver.fake_engine:make_engine", **slow},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5, "retry_backoff_s": 0.1},
            "output": {"url": output_url, "mode": "resume", "lease_ttl_s": 120.0},
            "stages": [
                {"name": "generate", "filter": "topic != 't2'", "engine": gated},
                {"name": "judge", "engine": {"factory": "tests.driver.judge_engine:make_judge"},
                 "input": {"prompt": "Judge ({topic}): {prompt} -> {generated_text}"},
                 "output_columns": {"score": "json.score"}, "filter": "json_valid and score >= 5"},
                {"name": "rewrite", "input": {"messages": [{"role": "user", "content": "Improve ({score})."}]},
                 "filter": "not (topic == 't1' and score == 9) and (id != 'p016' or topic > 3)"}]}


def _expected() -> tuple[dict[str, dict[str, int]], dict[str, set[str]]]:
    """The funnel each stage must show and the ids that reach each stage (and the final output)."""
    rows = {f"p{i:03d}": {"topic": None if i == NULL_TOPIC else f"t{i % 3}", "score": i % 10, "i": i}
            for i in range(N)}
    funnel, reach = {}, {"generate": set(rows)}
    judge = {r for r in rows if rows[r]["topic"] != "t2"}
    funnel["generate"] = {"rows_in": N, "kept": len(judge), "dropped": N - len(judge), "error": 0, "filter_error": 0}
    reach["judge"] = judge
    errors = {r for r in judge if rows[r]["topic"] is None}  # its template needs {topic}
    unparsed = {r for r in judge if rows[r]["i"] == UNPARSEABLE}
    rewrite = {r for r in judge - errors - unparsed if rows[r]["score"] >= 5}
    funnel["judge"] = {"rows_in": len(judge), "kept": len(rewrite), "error": len(errors), "filter_error": 0,
                       "dropped": len(judge) - len(rewrite) - len(errors)}
    reach["rewrite"] = rewrite
    filter_errors = {r for r in rewrite if rows[r]["i"] == FILTER_ERROR}
    final = {r for r in rewrite - filter_errors if not (rows[r]["topic"] == "t1" and rows[r]["score"] == 9)}
    funnel["rewrite"] = {"rows_in": len(rewrite), "kept": len(final), "error": 0, "filter_error": 1,
                         "dropped": len(rewrite) - len(final) - 1}
    reach["final"] = final
    return funnel, reach


def _committed(out: Path) -> dict:
    try:
        manifest = read_manifest_with_records(Storage(str(out)))
    except (OSError, ValueError):
        return {}
    return {s: e for s, e in ((manifest or {}).get("shards") or {}).items() if e["status"] == "committed"}


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob("*.parquet"))}


def _ids(folder: Path) -> list[str]:
    return sorted(pq.read_table(folder, columns=["id"]).column("id").to_pylist())


def _wait_for(predicate, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError("condition not reached")


def test_three_stage_pipeline_killed_in_stage_two_and_rerun(local_ray, tmp_path):
    ids = _write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    gate = tmp_path / "gate"
    data = _pipeline(str(tmp_path / "in.parquet"), str(out), step_delay_s=0.02, gate_file=str(gate))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-c", "from jobrunner.cli import main; main()", "run", str(tmp_path / "job.yaml"),
           "--address", ray.get_runtime_context().gcs_address, "--no-progress", "--no-report"]
    started = time.monotonic()
    driver = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # killed once the judge has committed shards and has more to do
        _wait_for(lambda: len(_committed(out / "stages/judge")) >= 2)
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    killed_s = time.monotonic() - started
    stages = {name: out / "stages" / name for name in ("generate", "judge", "rewrite")}
    before = {name: _committed(path) for name, path in stages.items()}
    assert 2 <= len(before["judge"]) < 8, "the judge was not killed mid-stage"
    parts_before = {name: _mtimes(path / "parts") for name, path in stages.items()}
    inputs_before = _mtimes(stages["judge"] / "_input")
    # streaming: the judge committed shards while the generator (held at 2 shards) still had shards to do
    assert len(before["generate"]) == 2, before["generate"]
    gate.touch()

    rerun_s = time.monotonic()
    result = run_pipeline(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    print(f"killed after {killed_s:.1f}s; rerun {time.monotonic() - rerun_s:.1f}s; committed before the kill: "
          + ", ".join(f"{k} {len(v)}" for k, v in before.items()))

    funnel, reach = _expected()
    for name, path in stages.items():  # every id once per stage, the ids that passed the filters before it
        got = _ids(path / "parts")
        assert got == sorted(reach[name]) and len(got) == len(set(got)), name
        for shard_id, entry in before[name].items():  # nothing committed before the kill was recomputed
            assert _committed(path)[shard_id]["worker_id"] == entry["worker_id"], (name, shard_id)
        now = _mtimes(path / "parts")
        assert {k: now[k] for k in parts_before[name]} == parts_before[name], f"{name}: a committed part rewritten"
    assert {k: v for k, v in _mtimes(stages["judge"] / "_input").items() if k in inputs_before} == inputs_before
    assert _ids(out / "parts") == sorted(reach["final"]) and set(reach["final"]) < set(ids)
    assert (out / "_SUCCESS").exists() and all((p / "_SUCCESS").exists() for p in stages.values())
    shown = {f["stage"]: {k: f[k] for k in ("rows_in", "kept", "dropped", "error", "filter_error")}
             for f in result.funnel}
    assert shown == funnel
    example = result.funnel[2]["filter_error_examples"][0]
    assert "stage rewrite" in example and "row p016" in example and "column 'topic'" in example
    judge_rows = pq.read_table(stages["judge"] / "parts", columns=["id", "error"]).to_pylist()
    assert [(r["id"], r["error"]) for r in judge_rows if r["error"]] == [
        ("p005", "stage judge: template column 'topic' is null in row p005")]
    final = {r["id"]: r for r in pq.read_table(out / "parts").to_pylist()}
    row = final["p006"]  # joins back to the input by id; every stage's text is there
    assert (row["prompt"], row["topic"], row["score"]) == ("question 6 about things", "t0", 6.0)
    assert row["judge.json_valid"] is True and "json_valid" not in row  # a judge's result column keeps its stage
    assert row["judge.generated_text"] == 'Verdict: {"score": 6}' and row["generate.generated_text"] == \
        "tok0 tok1 tok2 tok3"
    _check_reports(out, funnel)


def _check_reports(out: Path, funnel: dict[str, dict[str, int]]) -> None:
    """`jobrunner report OUT` on a pipeline: the funnel and $ / M kept rows in text, JSON and HTML."""
    import json

    from click.testing import CliRunner

    from jobrunner.cli import main

    runner = CliRunner()
    text = runner.invoke(main, ["report", str(out), "--worker-hour-usd", "1"])
    assert text.exit_code == 0, text.output
    kept = funnel["rewrite"]["kept"]
    assert f"64 rows in, {kept} kept" in text.output and "/ M kept rows" in text.output
    judge = funnel["judge"]
    assert re.search(rf"judge\s+generate\s+{judge['rows_in']}\s+{judge['kept']}\s+{judge['dropped']}\s+0\s+"
                     rf"{judge['error']}\s", text.output), text.output
    report = json.loads(runner.invoke(main, ["report", str(out), "--format", "json", "--worker-hour-usd", "1"]).output)
    assert [s["funnel"]["kept"] for s in report["stages"]] == [funnel[s]["kept"] for s in ("generate", "judge",
                                                                                           "rewrite")]
    assert report["rows_kept"] == kept and report["total_usd"] > 0
    assert report["usd_per_m_kept_rows"] == pytest.approx(report["total_usd"] / kept * 1e6)
    assert report["total_usd"] == pytest.approx(sum(s["report"]["cost"]["total_usd"] for s in report["stages"]))
    html = runner.invoke(main, ["report", str(out), "--format", "html"]).output
    assert "<h2>Funnel</h2>" in html and 'aria-label="pipeline funnel"' in html and "$ / M kept rows" in html
    status = runner.invoke(main, ["status", str(out)])
    assert status.exit_code == 0 and "complete (_SUCCESS written)" in status.output, status.output
    assert all(f"[stage {name}]" in status.output for name in funnel) and "funnel: generate 64 in" in status.output
    state = json.loads(runner.invoke(main, ["status", str(out), "--json"]).output)
    assert [s["status"]["state"] for s in state["stages"]] == ["complete"] * 3


@pytest.mark.heavy  # ~12 s quiet, ~25 s loaded: two workers load the model; the fake-engine test above is the default
def test_two_stages_on_our_engine_with_a_tiny_model(local_ray, tmp_path, tiny_llama_hf_dir):
    """generate -> judge, both our engine on a tiny random Llama (each stage its own worker): the judge's prompts
    are built from the generator's committed rows, and every id comes out of both stages and the pipeline."""
    ids = [f"r{i}" for i in range(8)]
    pq.write_table(pa.table({"id": ids, "prompt": [f"Say {i} things." for i in range(8)]}), tmp_path / "in.parquet")
    data = {"name": "tiny", "model": {"source": str(tiny_llama_hf_dir), "dtype": "float32"},
            "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id",
                      "rows_per_shard": 4},
            "sampling": {"max_tokens": 4, "temperature": 0.0}, "engine": {"max_num_seqs": 8, "num_kv_blocks": 64},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5},
            "output": {"url": str(tmp_path / "out"), "mode": "overwrite"},
            "stages": [{"name": "generate"},
                       {"name": "judge", "sampling": {"max_tokens": 3},
                        "input": {"prompt": "Rate the answer 1-10.\nQ: {prompt}\nA: {generated_text}\nScore:"},
                        "filter": "finish_reason in ['length', 'stop'] and num_output_tokens <= 3"}]}
    result = run_pipeline(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    out = tmp_path / "out"
    generated = {r["id"]: r for r in pq.read_table(out / "stages/generate/parts").to_pylist()}
    prompts = {r["id"]: r["_stage_prompt"] for r in pq.read_table(out / "stages/judge/_input").to_pylist()}
    assert sorted(generated) == ids and sorted(prompts) == ids
    for rid, row in generated.items():
        assert row["error"] is None and row["num_output_tokens"] >= 1
        assert prompts[rid] == f"Rate the answer 1-10.\nQ: {row['prompt']}\nA: {row['generated_text']}\nScore:"
    judged = pq.read_table(out / "stages/judge/parts").to_pylist()
    assert sorted(r["id"] for r in judged) == ids and all(r["num_output_tokens"] <= 3 for r in judged)
    assert _ids(out / "parts") == ids
    assert [(f["rows_in"], f["kept"]) for f in result.funnel] == [(8, 8), (8, 8)]


@pytest.mark.heavy  # two pipeline runs (~15 s quiet): the default suite keeps the kill-and-rerun test
def test_incremental_nights_run_only_the_new_rows_through_every_stage(local_ray, tmp_path):
    """output.mode incremental: night 2 adds a file; stage 1 runs only its rows, the judge only the new stage-1
    shards, the earlier nights' parts stay as they are, and the final output holds every kept id once."""
    folder = tmp_path / "in"
    folder.mkdir()
    rows = {f"n{i:02d}": f"question {i} about things" for i in range(24)}
    first, second = dict(list(rows.items())[:16]), dict(list(rows.items())[16:])
    pq.write_table(pa.table({"id": list(first), "prompt": list(first.values())}), folder / "night1.parquet",
                   row_group_size=8)
    data = {"name": "nightly-judged",
            "input": {"url": str(folder), "prompt_column": "prompt", "id_column": "id", "rows_per_shard": 8},
            "sampling": {"max_tokens": 2},
            "engine": {"max_num_seqs": 8, "factory": "tests.driver.fake_engine:make_engine"},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5},
            "output": {"url": str(tmp_path / "out"), "mode": "incremental"},
            "stages": [{"name": "gen"},
                       {"name": "judge", "engine": {"factory": "tests.driver.judge_engine:make_judge"},
                        "input": {"prompt": "{prompt}"}, "output_columns": {"score": "json.score"},
                        "filter": "score >= 4"}]}
    assert run_pipeline(spec_from_dict(data), show_progress=False).ok
    out = tmp_path / "out"
    night1 = {name: _mtimes(out / "stages" / name / "parts") for name in ("gen", "judge")}
    final1 = _mtimes(out / "parts")
    pq.write_table(pa.table({"id": list(second), "prompt": list(second.values())}), folder / "night2.parquet")
    result = run_pipeline(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    for name, before in night1.items():
        now = _mtimes(out / "stages" / name / "parts")
        assert {k: now[k] for k in before} == before and len(now) == len(before) + 1, name  # one new shard each
    assert {k: v for k, v in _mtimes(out / "parts").items() if k in final1} == final1
    assert _ids(out / "stages/gen/parts") == sorted(rows) and _ids(out / "stages/judge/parts") == sorted(rows)
    assert _ids(out / "parts") == sorted(i for i in rows if int(i[1:]) % 10 >= 4)
    assert [(f["rows_in"], f["kept"]) for f in result.funnel] == [(24, 24), (24, len(_ids(out / "parts")))]


@pytest.mark.heavy  # a second pipeline run on the moto server; the local-disk tests above cover the logic
def test_pipeline_on_s3(local_ray, s3_server):
    """Input, every stage's output, the stage inputs and the final rows on an S3 server (moto): the same ids."""
    from jobrunner.io.parts import read_output
    from tests.driver.helpers import new_bucket, write_prompts

    bucket, opts = new_bucket(s3_server), s3_server["storage_options"]
    ids = write_prompts(f"s3://{bucket}/data/in.parquet", 16, storage_options=opts)
    data = {"name": "s3-pipeline",
            "input": {"url": f"s3://{bucket}/data/", "prompt_column": "prompt", "id_column": "id", "rows_per_shard": 8,
                      "storage_options": opts},
            "sampling": {"max_tokens": 2},
            "engine": {"max_num_seqs": 8, "factory": "tests.driver.fake_engine:make_engine"},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 0.5},
            "output": {"url": f"s3://{bucket}/out", "storage_options": opts},
            "stages": [{"name": "gen"},
                       {"name": "judge", "engine": {"factory": "tests.driver.judge_engine:make_judge"},
                        "input": {"prompt": "{prompt}"}, "output_columns": {"score": "json.score"},
                        "filter": "score >= 5"}]}
    result = run_pipeline(spec_from_dict(data), show_progress=False)
    assert result.ok, result.summary()
    judged = read_output(f"s3://{bucket}/out/stages/judge", opts).column("id").to_pylist()
    final = read_output(f"s3://{bucket}/out", opts).to_pylist()
    assert sorted(judged) == ids
    assert sorted(r["id"] for r in final) == [i for i in ids if int(i[1:]) % 10 >= 5]
    assert all(r["score"] >= 5 for r in final)
