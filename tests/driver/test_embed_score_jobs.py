"""Embed and score jobs end to end on the real engine (tiny random Llama), real local Ray, local disk: the result
columns and their Arrow types, error rows, the manifest's task facts, the report's input-token cost, and an
OpenAI batch of /v1/embeddings lines answered as OpenAI embedding responses."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from jobrunner.driver.job import run_job
from jobrunner.io.parts import read_output
from jobrunner.reports import load_report
from jobrunner.reports.text import render_text
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import read_manifest_file

pytestmark = pytest.mark.timeout(600)
PROMPTS = ["the quick brown fox", "hello world", None, "the quick brown fox jumps", "a b c d e f"]
COMPLETIONS = [" jumps over", " again", " x", None, " g h"]


def _spec(model_dir, out, task: str, input_section: dict, **extra) -> dict:
    return {"name": f"{task}-job", "task": task, "model": {"source": str(model_dir), "dtype": "float32"},
            "input": {"rows_per_shard": 3, **input_section},
            "engine": {"max_num_seqs": 4, "num_kv_blocks": 64, "block_size": 4},
            "cluster": {"num_workers": 1, "num_cpus_per_worker": 1, "retry_backoff_s": 0.1},
            "output": {"url": str(out), "mode": "overwrite", "max_error_rate": 1.0}, **extra}


def _write_input(path) -> None:
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    pq.write_table(pa.table({"id": ids, "prompt": PROMPTS, "completion": COMPLETIONS}), str(path))


def _by_id(out) -> dict[str, dict]:
    return {r["id"]: r for r in read_output(str(out)).to_pylist()}


def test_embed_job_rows_manifest_report(local_ray, tmp_path, tiny_llama_hf_dir):
    from transformers import AutoModel, AutoTokenizer

    _write_input(tmp_path / "in.parquet")
    out = tmp_path / "out"
    spec = _spec(tiny_llama_hf_dir, out, "embed", {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                                   "id_column": "id"}, embed={"normalize": True})
    assert run_job(spec_from_dict(spec), show_progress=False).ok
    table = read_output(str(out))
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    rows = _by_id(out)
    assert rows["r2"]["embedding"] is None and "prompt column 'prompt'" in rows["r2"]["error"]
    hf = AutoModel.from_pretrained(str(tiny_llama_hf_dir)).eval()  # the bare decoder of the causal checkpoint
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_hf_dir))
    for rid in ("r0", "r1", "r3", "r4"):
        row = rows[rid]
        assert row["error"] is None and row["generated_text"] is None and row["num_output_tokens"] == 0
        ids = tokenizer(PROMPTS[int(rid[1:])])["input_ids"]
        assert row["num_prompt_tokens"] == len(ids) and row["ttft_s"] is not None
        with torch.no_grad():
            want = torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
        assert torch.allclose(torch.tensor(row["embedding"]), want, atol=1e-4)  # last token, normalised
    manifest = read_manifest_file(out)
    assert manifest["task"] == "embed"
    model = manifest["model"]
    assert (model["task"], model["pooling"], model["normalize"], model["embedding_dim"]) == ("embed", "last",
                                                                                            True, 64)
    report = load_report(str(out), worker_hour_usd=3.6)
    assert report["tokens"]["output"] == 0 and report["tokens"]["input"] == sum(
        rows[r]["num_prompt_tokens"] for r in ("r0", "r1", "r3", "r4"))
    assert report["cost"]["usd_per_m_input"] > 0 and report["cost"]["prefill_share"] == 1.0
    assert report["throughput"]["input_tokens_per_s"] > 0
    text = render_text([report])
    assert "input tokens/s" in text and "embedding dimension" in text and "prefill only" in text


def test_score_job_loglik(local_ray, tmp_path, tiny_llama_hf_dir):
    from transformers import AutoTokenizer

    _write_input(tmp_path / "in.parquet")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_hf_dir))
    # log-likelihood of the completion column, on the causal model
    out = tmp_path / "loglik"
    spec = _spec(tiny_llama_hf_dir, out, "score", {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                                   "id_column": "id", "completion_column": "completion"})
    assert run_job(spec_from_dict(spec), show_progress=False).ok
    rows = _by_id(out)
    assert "completion column 'completion'" in rows["r3"]["error"] and rows["r3"]["completion_logprob"] is None
    for rid in ("r0", "r1", "r4"):
        row, i = rows[rid], int(rid[1:])
        num = len(tokenizer(COMPLETIONS[i], add_special_tokens=False)["input_ids"])
        assert row["num_completion_tokens"] == num == len(row["completion_logprobs"])
        assert row["num_prompt_tokens"] == len(tokenizer(PROMPTS[i])["input_ids"]) + num
        assert row["completion_logprob"] == pytest.approx(sum(row["completion_logprobs"]), abs=1e-4)
        assert row["completion_logprob"] < 0


def test_classifier_rows_and_manifest_labels(tmp_path, tiny_llama_hf_dir):
    """A sequence-classification checkpoint through the worker's own row functions (no Ray: the row pipeline is
    the one the jobs above run): `scores` per label, and the label names in the manifest's model section."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from jobrunner.driver.engine_factory import build_engine, describe_model
    from jobrunner.driver.pooled import job_pooling
    from jobrunner.driver.rows import job_output_schema, output_row, to_request
    from jobrunner.io.parts import rows_to_table
    from jobrunner.io.reader import ROW_INDEX

    config = LlamaConfig.from_pretrained(str(tiny_llama_hf_dir), num_labels=2, id2label={0: "bad", 1: "good"},
                                         label2id={"bad": 0, "good": 1}, architectures=None)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(str(tmp_path / "clf"))
    AutoTokenizer.from_pretrained(str(tiny_llama_hf_dir)).save_pretrained(str(tmp_path / "clf"))
    spec = spec_from_dict(_spec(tmp_path / "clf", tmp_path / "out", "score",
                                {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt", "id_column": "id"}))
    engine = build_engine(spec)
    model = describe_model(engine, spec)
    assert (model["task"], model["labels"], model["architecture"]) == ("classify", ["bad", "good"],
                                                                        "LlamaForSequenceClassification")
    params = job_pooling(spec, engine.model_info)
    reqs = [to_request(spec, "in", {ROW_INDEX: i, "id": f"r{i}", "prompt": p}, params) for i, p in enumerate(PROMPTS)]
    assert "prompt column 'prompt'" in reqs[2].error
    outs = engine.generate([r.prompt for r in reqs if r.error is None], params)
    rows = [output_row(spec, r, o) for r, o in zip([r for r in reqs if r.error is None], outs)]
    table = rows_to_table(rows, schema=job_output_schema(spec))
    assert table.schema.field("scores").type == pa.list_(pa.float32())
    scores = table.column("scores").to_pylist()
    assert all(len(x) == 2 for x in scores) and scores[0] != scores[1] and table.column("error").null_count == 4


def test_openai_batch_embeddings(tmp_path, tiny_llama_hf_dir):
    """/v1/embeddings request lines through the worker's row functions (no Ray) to OpenAI embedding responses,
    parsed by the openai package; a chat line in an embed job and a line of several inputs are error rows."""
    from openai.types import CreateEmbeddingResponse

    from jobrunner.driver.engine_factory import build_engine
    from jobrunner.driver.openai_batch import result_lines
    from jobrunner.driver.pooled import job_pooling
    from jobrunner.driver.rows import error_row, output_row, to_request
    from jobrunner.io.reader import ROW_INDEX

    bodies = {"e0": ("/v1/embeddings", {"input": "hello world"}),
              "e1": ("/v1/embeddings", {"input": ["the quick brown fox"], "encoding_format": "float",
                                        "model": tiny_llama_hf_dir.name}),  # the source's last part names it too
              "e2": ("/v1/embeddings", {"input": ["a", "b"]}),
              "e3": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})}
    spec = spec_from_dict(_spec(tiny_llama_hf_dir, tmp_path / "out", "embed",
                                {"url": str(tmp_path / "b.jsonl"), "format": "openai_batch"}))
    engine = build_engine(spec)
    params = job_pooling(spec, engine.model_info)
    reqs = [to_request(spec, "b", {ROW_INDEX: i, "custom_id": cid, "method": "POST", "url": url,
                                   "body": json.dumps(body)}, params)
            for i, (cid, (url, body)) in enumerate(bodies.items())]
    ok = [r for r in reqs if r.error is None]
    assert [r.row_id for r in ok] == ["e0", "e1"]
    rows = [output_row(spec, r, o) for r, o in zip(ok, engine.generate([r.prompt for r in ok], params))]
    rows += [{**error_row(r), "_status": 400} for r in reqs if r.error is not None]
    outputs, errors = result_lines(rows, {cid: "embeddings" for cid in bodies}, "tiny", "embed-job")
    assert "one input per line" in errors[0]["response"]["body"]["error"]["message"]
    assert "task embed job reads /v1/embeddings lines only" in errors[1]["response"]["body"]["error"]["message"]
    for line, row in zip(outputs, rows):
        body = CreateEmbeddingResponse.model_validate(line["response"]["body"])
        assert line["custom_id"] == row["id"] and len(body.data[0].embedding) == 64
        assert body.data[0].embedding == pytest.approx(row["embedding"]) and body.usage.prompt_tokens > 0
