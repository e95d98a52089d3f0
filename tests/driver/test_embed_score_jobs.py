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


def test_score_jobs_loglik_and_classifier(local_ray, tmp_path, tiny_llama_hf_dir):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

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
    # a sequence-classification head: scores per label, label names in the manifest
    config = LlamaConfig.from_pretrained(str(tiny_llama_hf_dir), num_labels=2, id2label={0: "bad", 1: "good"},
                                         label2id={"bad": 0, "good": 1})
    torch.manual_seed(0)
    classifier_dir = tmp_path / "classifier"
    LlamaForSequenceClassification(config).save_pretrained(str(classifier_dir))
    tokenizer.save_pretrained(str(classifier_dir))
    out = tmp_path / "classify"
    spec = _spec(classifier_dir, out, "score", {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt",
                                                "id_column": "id"})
    assert run_job(spec_from_dict(spec), show_progress=False).ok
    table = read_output(str(out))
    assert table.schema.field("scores").type == pa.list_(pa.float32())
    rows = _by_id(out)
    assert all(len(rows[r]["scores"]) == 2 for r in ("r0", "r1", "r3", "r4")) and rows["r2"]["scores"] is None
    assert rows["r0"]["scores"] != rows["r1"]["scores"]
    model = read_manifest_file(out)["model"]
    assert model["task"] == "classify" and model["labels"] == ["bad", "good"]


def test_openai_batch_embeddings(local_ray, tmp_path, tiny_llama_hf_dir):
    from openai.types import CreateEmbeddingResponse

    lines = [{"custom_id": "e0", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hello world"}},
             {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
              "body": {"input": ["the quick brown fox"], "model": "x", "encoding_format": "float"}},
             {"custom_id": "e2", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["a", "b"]}},
             {"custom_id": "e3", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "hi"}]}}]
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    spec = _spec(tiny_llama_hf_dir, out, "embed", {"url": str(path), "format": "openai_batch"})
    assert run_job(spec_from_dict(spec), show_progress=False).ok
    rows = _by_id(out)
    results = [json.loads(x) for x in (out / "_openai" / "output.jsonl").read_text().splitlines()]
    errors = {json.loads(x)["custom_id"]: json.loads(x) for x in (out / "_openai" / "errors.jsonl").read_text()
              .splitlines()}
    assert [r["custom_id"] for r in results] == ["e0", "e1"] and set(errors) == {"e2", "e3"}
    assert "one input per line" in errors["e2"]["response"]["body"]["error"]["message"]
    assert "task embed" in errors["e3"]["response"]["body"]["error"]["message"]
    for result in results:
        body = CreateEmbeddingResponse.model_validate(result["response"]["body"])
        row = rows[result["custom_id"]]
        assert body.data[0].embedding == pytest.approx(row["embedding"], abs=1e-6)
        assert body.usage.prompt_tokens == row["num_prompt_tokens"] > 0
