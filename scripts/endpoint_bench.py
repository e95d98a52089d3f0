"""engine.backend openai, measured against vLLM's own OpenAI server on the embedded SmolLM2 (float32, CPU):

1. `budget`: an N-row job (default 200) through the fault proxy answering a share of requests (default 30%) with
   429 and `Retry-After: 1`, under a requests- and tokens-per-minute budget: error rows, the most requests and
   tokens the server saw in any 60 s against the budgets, and the time from the first request the server saw
   to the last answer against the ideal the budget allows (max(N / RPM, tokens / TPM) minutes).
2. `compare`: the same 16 rows (float32, greedy) through engine.backend vllm (vLLM's engine in the worker)
   and through the endpoint: how many texts are equal, and the report's $ / M of both side by side
   (`jobrunner report A B`).

    PYTHONPATH=. .venv/bin/python scripts/endpoint_bench.py budget [--rows 200] [--rpm 180] [--tpm 20000]
    PYTHONPATH=. .venv/bin/python scripts/endpoint_bench.py compare
    (--url http://127.0.0.1:PORT/v1: a server already running, serving the model as "smollm2")
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jobrunner.driver.job import run_job  # noqa: E402
from jobrunner.io.parts import read_output  # noqa: E402
from jobrunner.spec import load_spec  # noqa: E402
from tests.endpoint.proxy import FaultProxy, max_in_window  # noqa: E402

EXAMPLE = REPO / "jobs" / "example.yaml"
PROMPTS = REPO / "examples" / "data" / "prompts.parquet"


def rows_file(folder: Path, count: int) -> Path:
    """`count` rows of the example prompts (repeated with new ids past 64)."""
    table = pq.read_table(PROMPTS)
    ids, messages = [], []
    for i in range(count):
        row = i % table.num_rows
        ids.append(f"{table.column('id')[row].as_py()}-{i // table.num_rows}")
        messages.append(table.column("messages")[row].as_py())
    path = folder / f"rows-{count}.parquet"
    pq.write_table(pa.table({"id": ids, "messages": pa.array(messages, table.schema.field("messages").type),
                             "source": [table.column("source")[i % table.num_rows].as_py() for i in range(count)]}),
                   path)
    return path


def endpoint_overrides(url: str, extra: list[str]) -> list[str]:
    return ["engine.backend=openai", f"engine.endpoint.base_url={url}", "engine.endpoint.model=smollm2", *extra]


def budget(url: str, folder: Path, args: argparse.Namespace) -> dict:
    """The N-row job under 429s and the budgets; what the server saw."""
    inputs = rows_file(folder, args.rows)
    with FaultProxy(url, seed=1, rate_429=args.rate_429, retry_after="1") as proxy:
        spec = load_spec(EXAMPLE, [
            f"input.url={inputs}", "input.rows_per_shard=25", f"sampling.max_tokens={args.max_tokens}",
            f"output.url={folder / 'budget-out'}", "cluster.num_cpus_per_worker=1", "engine.max_num_seqs=32",
            *endpoint_overrides(proxy.url, [
                f"engine.endpoint.max_concurrency={args.concurrency}",
                f"engine.endpoint.requests_per_minute={args.rpm}",
                f"engine.endpoint.tokens_per_minute={args.tpm}", "engine.endpoint.max_retries=30",
                "cost.usd_per_m_input=0.15", "cost.usd_per_m_output=0.60"])])
        started = time.monotonic()
        result = run_job(spec, show_progress=False)
        wall_s = time.monotonic() - started
        records = list(proxy.records)
    forwarded = [r for r in records if r.outcome == "forwarded"]
    rows = read_output(str(folder / "budget-out")).to_pylist()
    with open(folder / "proxy-records.jsonl", "w") as f:  # what the server saw, for a closer look
        for r in records:
            f.write(json.dumps({"time": r.time, "outcome": r.outcome, "answered": r.answered,
                                "tokens": r.tokens}) + "\n")
    latencies = sorted(r.answered - r.time for r in forwarded)
    tokens = sum(r.tokens for r in forwarded)
    first = min(r.time for r in records)
    last_answer = max(r.answered for r in forwarded)
    ideal_s = max(len(forwarded) / args.rpm, tokens / args.tpm) * 60.0
    served_s = last_answer - first
    return {"ok": result.ok, "rows": len(rows), "error_rows": sum(r["error"] is not None for r in rows),
            "requests_at_proxy": len(records), "answered_429": sum(r.outcome == "429" for r in records),
            "forwarded": len(forwarded), "tokens_at_server": tokens,
            "max_requests_in_60s": max_in_window(forwarded, 60.0), "rpm_budget": args.rpm,
            "max_tokens_in_60s": max_in_window(forwarded, 60.0, tokens=True), "tpm_budget": args.tpm,
            "first_request_to_last_answer_s": round(served_s, 1), "ideal_s": round(ideal_s, 1),
            "time_over_ideal": round(served_s / ideal_s, 3), "job_wall_s": round(wall_s, 1),
            "server_latency_s_p50_p95": [round(latencies[len(latencies) // 2], 2),
                                         round(latencies[int(len(latencies) * 0.95)], 2)]}


def compare(url: str, folder: Path, python: str) -> dict:
    """16 rows, float32 greedy, through engine.backend vllm and through the endpoint; their reports."""
    from jobrunner.reports.job import load_report

    inputs = rows_file(folder, 16)
    common = [f"input.url={inputs}", "input.rows_per_shard=8", "sampling.max_tokens=48",
              "sampling.repetition_penalty=1.0", "model.dtype=float32", "cluster.num_cpus_per_worker=1",
              "cost.worker_hour_usd=0.10"]
    local = load_spec(EXAMPLE, [*common, f"output.url={folder / 'vllm-out'}", "engine.backend=vllm",
                                f"engine.vllm_python={python}", "engine.max_model_len=2048"])
    remote = load_spec(EXAMPLE, [*common, f"output.url={folder / 'endpoint-out'}", *endpoint_overrides(
        url, ["cost.usd_per_m_input=0.15", "cost.usd_per_m_output=0.60"])])
    assert run_job(local, show_progress=False).ok and run_job(remote, show_progress=False).ok
    texts = [{r["id"]: r["generated_text"] for r in read_output(str(folder / name)).to_pylist()}
             for name in ("vllm-out", "endpoint-out")]
    equal = sum(texts[0][i] == texts[1].get(i) for i in texts[0])
    reports = {name: load_report(str(folder / name)) for name in ("vllm-out", "endpoint-out")}
    return {"equal_texts": equal, "rows": len(texts[0]),
            "differing": {i: [texts[0][i], texts[1].get(i)] for i in texts[0] if texts[0][i] != texts[1].get(i)},
            "cost": {name: {k: v for k, v in report["cost"].items() if k != "notes"}
                     for name, report in reports.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["budget", "compare"])
    parser.add_argument("--url", help="a running server (…/v1) serving SmolLM2 as 'smollm2'; default: start one")
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--rpm", type=float, default=180.0)
    parser.add_argument("--tpm", type=float, default=20000.0)
    parser.add_argument("--rate-429", type=float, default=0.3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32, help="engine.endpoint.max_concurrency")
    parser.add_argument("--keep", help="a folder to keep the outputs in")
    args = parser.parse_args()
    python = os.environ.get("JOBRUNNER_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    server = None
    if args.url is None:
        from jobrunner.models.sources import resolve_model_dir
        from tests.endpoint.server import start_vllm_server

        started = time.monotonic()
        server = start_vllm_server(python, str(resolve_model_dir("smollm2-135m-instruct")))
        print(f"vLLM's server up in {time.monotonic() - started:.1f} s at {server.url}", flush=True)
    url = args.url or server.url
    folder = Path(args.keep or tempfile.mkdtemp(prefix="endpoint-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = budget(url, folder, args) if args.what == "budget" else compare(url, folder, python)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
