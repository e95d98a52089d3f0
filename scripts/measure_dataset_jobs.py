"""Dataset-generation jobs side by side, through run_job on a local Ray (the issue-9 closing measurements).

Cases (each one job over GSM8K questions from examples/data/gsm8k_64.jsonl):
  n4       `--rows` questions, sampling.n = 4
  n1x4     the same questions each repeated 4 times (distinct ids), n = 1
  plain    `--rows` questions, greedy                      (the baseline of the next two)
  json     the same with sampling.json_schema              (grammar overhead at batch max_num_seqs)
  logprobs the same with sampling.logprobs = 5             (top-5 logprobs overhead)
For each: rows, prompt tokens (as written, and computed by the engine = workers' num_prefill_tokens), cached
tokens, output tokens, engine prefill/decode seconds, wall seconds and output tokens/s. Prints a JSON list.

Usage: python scripts/measure_dataset_jobs.py [--model smollm2-135m-instruct] [--rows 64] [--max-tokens 64]
       [--cases n4,n1x4,plain,json,logprobs] [--no-prefix-caching]
Run it on a quiet machine; the numbers depend on everything else running.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import ray

from jobrunner.driver.job import run_job
from jobrunner.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "confident": {"type": "boolean"}},
          "required": ["answer", "confident"], "additionalProperties": False}
CASES = {
    "n4": (1, {"n": 4, "temperature": 0.8, "seed": 0}),
    "n1x4": (4, {"temperature": 0.8, "seed": 0}),
    "plain": (1, {}),
    "json": (1, {"json_schema": SCHEMA}),
    "logprobs": (1, {"logprobs": 5}),
}


def write_rows(path: Path, num_rows: int, repeat: int) -> None:
    rows = [json.loads(line) for line in (REPO / "examples/data/gsm8k_64.jsonl").open()][:num_rows]
    with path.open("w") as fh:
        for copy in range(repeat):
            for row in rows:
                fh.write(json.dumps({**row, "id": f"{row['id']}#{copy}"}) + "\n")


def run_case(name: str, args: argparse.Namespace, work: Path) -> dict:
    repeat, sampling = CASES[name]
    data = work / f"{name}.jsonl"
    write_rows(data, args.rows, repeat)
    spec = spec_from_dict({
        "name": f"measure-{name}", "model": {"source": args.model},
        "input": {"url": str(data), "messages_column": "messages", "id_column": "id", "rows_per_shard": 10_000},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True, **sampling},
        "engine": {"max_num_seqs": args.max_num_seqs, "enable_prefix_caching": not args.no_prefix_caching},
        "cluster": {"num_workers": 1, "num_cpus_per_worker": args.cpus},
        "output": {"url": str(work / f"out-{name}"), "mode": "overwrite"}})
    t0 = time.perf_counter()
    result = run_job(spec, show_progress=False)
    wall_s = time.perf_counter() - t0
    totals, workers = result.manifest["totals"], result.manifest["workers"].values()
    decode_s = sum(w.get("decode_s", 0.0) for w in workers)
    return {"case": name, "ok": result.ok, "rows": totals["rows"], "errors": totals["num_errors"],
            "prompt_tokens_counted": totals["num_prompt_tokens"],
            "prompt_tokens_computed": sum(w.get("num_prefill_tokens", 0) for w in workers),
            "cached_tokens": totals["num_cached_tokens"], "output_tokens": totals["num_output_tokens"],
            "prefill_s": round(sum(w.get("prefill_s", 0.0) for w in workers), 3), "decode_s": round(decode_s, 3),
            "wall_s": round(wall_s, 2),
            "output_tokens_per_engine_s": round(totals["num_output_tokens"] / max(
                decode_s + sum(w.get("prefill_s", 0.0) for w in workers), 1e-9), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--cpus", type=float, default=2.0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    # One local Ray for every case (address="local": never join another cluster found on this machine).
    ray.init(address="local", num_cpus=max(2, int(args.cpus)), include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = [run_case(name, args, Path(tmp)) for name in args.cases.split(",")]
    finally:
        ray.shutdown()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
