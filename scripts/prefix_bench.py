"""Prefix-aware vs plain sharding on few-shot workloads, over 1, 2 and 4 workers (issue 18, item 1).

Two workloads. `rotated` (few prefixes): GSM8K test questions behind the 8 chain-of-thought exemplars of
lm-evaluation-harness (`../shared/data/gsm8k_test_8shot_cot.prompts.jsonl`), the exemplars rotated to make
`--prefixes` distinct few-shot prefixes (rotation k starts with exemplar k), row i behind prefix
i % prefixes. `sampled` (many prefixes): `--prefixes` distinct sets of `--shots` worked GSM8K test problems
(`../shared/data/gsm8k_test.jsonl`, held-out items 1000..), `--rows-per-prefix LO HI` questions behind each.
The rows are shuffled so rows sharing a prefix are not contiguous. Each configuration is one `run_job` on a
fresh local Ray with the real SmolLM2-135M engine (`--max-tokens` output tokens, EOS ignored, the engine's
default KV cache unless `--kv-mib`), `input.prefix_grouping` auto (prefix-aware) or off (plain row-range
shards, rows admitted in input order).

Printed per run: the prefix-cache hit rate, the job's own ideal (manifest `prefix_cache`) and the exact ideal
computed here over the whole job (every prompt tokenized, every distinct full-block chain counted once:
block_size x sum over chains of (prompts holding it - 1)), hits as a share of the exact ideal, computed prompt
tokens (prompt - cached), each worker's busy time (its first row admitted to its last row finished), and
total tokens/s (prompt + output tokens) over the processing span (first row admitted to last row finished
on any worker, from the rows' own timestamps: worker start-up and model load left out) and over the job's
wall time. Not a test: numbers mean something only on a quiet machine (wrap in
`/work/wt/cpu-run --exclusive` on the shared one). scripts/prefix_replay.py gives the computed tokens
without a model, in seconds.

    PYTHONPATH=. .venv/bin/python scripts/prefix_bench.py --rows 128 --prefixes 16 --workers 1 2 4
    PYTHONPATH=. .venv/bin/python scripts/prefix_bench.py --workload sampled --prefixes 96 --workers 2
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gsm8k_test_8shot_cot.prompts.jsonl"
TEST = REPO.parent / "shared" / "data" / "gsm8k_test.jsonl"


def workload(num_rows: int, num_prefixes: int, seed: int) -> list[tuple[str, str]]:
    """(id, prompt) rows: the question of row i behind rotation i % num_prefixes of the 8 exemplars."""
    lines = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[:num_rows]]
    exemplars = lines[0].split("\n\n")[:8]
    rows = []
    for i, prompt in enumerate(lines):
        question = prompt.split("\n\n")[-1]
        k = i % num_prefixes
        rotated = exemplars[k % 8:] + exemplars[:k % 8]
        if k >= 8:
            rotated = rotated[::-1]
        rows.append((f"q{i:05d}", "\n\n".join(rotated + [question])))
    random.Random(seed).shuffle(rows)
    return rows


def sampled_workload(num_prefixes: int, rows_per_prefix: tuple[int, int], shots: int,
                     seed: int) -> list[tuple[str, str]]:
    """(id, prompt) rows: `num_prefixes` distinct few-shot prefixes, each `shots` worked GSM8K test problems
    (question, answer without its <<calc>> marks, "The answer is N.") drawn from held-out items 1000..1318,
    then lo..hi rows (GSM8K test questions 0.., each used once) behind each prefix; the rows shuffled."""
    items = [json.loads(line) for line in TEST.read_text().splitlines()]
    pool, questions = items[1000:], iter(items[:1000])
    rng = random.Random(seed)
    rows = []
    for k in range(num_prefixes):
        prefix = "\n\n".join(_shot(item) for item in rng.sample(pool, shots))
        for _ in range(rng.randint(*rows_per_prefix)):
            question = next(questions)["question"]
            rows.append((f"p{k:03d}-{len(rows):05d}", f"{prefix}\n\nQ: {question}\nA:"))
    rng.shuffle(rows)
    return rows


def _shot(item: dict) -> str:
    body, answer = item["answer"].split("####")
    body = re.sub(r"<<[^>]*>>", "", body).strip().replace("\n", " ")
    return f"Q: {item['question']}\nA: {body} The answer is {answer.strip()}."


def exact_ideal(prompts: list[str], block_size: int) -> tuple[int, int]:
    """(prompt tokens, ideal cached tokens) over the whole job, tokenized as the engine does a raw prompt."""
    tok = tokenizer()
    holders: Counter = Counter()  # chain (all tokens up to the end of a full block) -> prompts holding it
    total = 0
    for prompt in prompts:
        ids = tok(prompt)["input_ids"]
        total += len(ids)
        for i in range((len(ids) - 1) // block_size):  # the last token is always computed
            holders[tuple(ids[:(i + 1) * block_size])] += 1
    return total, block_size * sum(n - 1 for n in holders.values())


def tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer (the engine's)."""
    from transformers import AutoTokenizer

    from jobrunner.models.sources import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2-135m-instruct")))


def run_one(input_path: Path, out: Path, workers: int, grouping: str, args: argparse.Namespace) -> dict:
    from jobrunner.driver.job import run_job
    from jobrunner.io.manifest import read_manifest
    from jobrunner.io.parts import read_output
    from jobrunner.io.storage import Storage
    from jobrunner.spec import spec_from_dict

    engine = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    if args.kv_mib:
        engine["kv_cache_memory_bytes"] = args.kv_mib * 1024 * 1024
    spec = spec_from_dict({
        "name": f"prefix-bench-{grouping}-{workers}w",
        "input": {"url": str(input_path), "prompt_column": "prompt", "id_column": "id",
                  "rows_per_shard": args.rows_per_shard, "prefix_grouping": grouping},
        "sampling": {"max_tokens": args.max_tokens, "ignore_eos": True},
        "engine": engine,
        "cluster": {"num_workers": workers, "num_cpus_per_worker": 1},
        "output": {"url": str(out), "mode": "overwrite"}})
    started = time.monotonic()
    result = run_job(spec, show_progress=False)
    wall = time.monotonic() - started
    manifest = read_manifest(Storage(str(out)))
    table = read_output(str(out)).to_pydict()
    first_in = min(f - e for f, e in zip(table["finish_time_s"], table["e2e_s"], strict=True))
    span = max(table["finish_time_s"]) - first_in
    busy = _worker_busy(table)
    totals = manifest["totals"]
    cache = manifest.get("prefix_cache") or {}
    tokens = totals["num_prompt_tokens"] + totals["num_output_tokens"]
    return {"grouping": grouping, "workers": workers, "ok": result.ok, "rows": totals["rows"],
            "prompt_tokens": totals["num_prompt_tokens"], "cached_tokens": totals["num_cached_tokens"],
            "output_tokens": totals["num_output_tokens"],
            "computed_prompt_tokens": totals["num_prompt_tokens"] - totals["num_cached_tokens"],
            "job_ideal_cached_tokens": cache.get("ideal_cached_tokens"), "span_s": round(span, 2),
            "wall_s": round(wall, 2), "tokens_per_s_span": round(tokens / span, 1),
            "tokens_per_s_wall": round(tokens / wall, 1),
            "files_grouped": (manifest.get("prefix_plan") or {}).get("files_grouped"),
            "worker_busy_s": busy, "worker_rows": Counter(table["worker_id"]),
            "first_row_in_s": round(first_in, 2)}


def _worker_busy(table: dict) -> dict[str, float]:
    """Each worker's processing time: its first row admitted to its last row finished (seconds)."""
    spans: dict[str, list[float]] = {}
    for worker, finish, e2e in zip(table["worker_id"], table["finish_time_s"], table["e2e_s"], strict=True):
        lo, hi = spans.setdefault(worker, [finish - e2e, finish])
        spans[worker] = [min(lo, finish - e2e), max(hi, finish)]
    return {w: round(hi - lo, 2) for w, (lo, hi) in sorted(spans.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--rows-per-shard", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=0, help="KV cache per worker (MiB); 0 = engine default")
    parser.add_argument("--workload", choices=["rotated", "sampled"], default="rotated",
                        help="rotated: --rows questions behind --prefixes rotations of lm-eval's 8 exemplars; "
                             "sampled: --prefixes distinct sets of --shots worked GSM8K problems, "
                             "--rows-per-prefix LO HI questions behind each")
    parser.add_argument("--rows-per-prefix", type=int, nargs=2, default=[2, 8])
    parser.add_argument("--shots", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["auto", "off"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.workload == "sampled":
        rows = sampled_workload(args.prefixes, tuple(args.rows_per_prefix), args.shots, args.seed)
    else:
        rows = workload(args.rows, args.prefixes, args.seed)
    prompt_of = dict(rows)
    total, ideal = exact_ideal([p for _, p in rows], 16)
    print(json.dumps({"workload": args.workload, "rows": len(rows), "prefixes": args.prefixes, "prompt_tokens": total,
                      "exact_ideal_cached_tokens": ideal, "exact_ideal_hit_rate": round(ideal / total, 4)}),
          flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="prefix-bench-") as tmp:
        input_path = Path(tmp) / "in.parquet"
        pq.write_table(pa.table({"id": [r for r, _ in rows], "prompt": [p for _, p in rows]}), input_path,
                       row_group_size=32)
        for workers in args.workers:
            for mode in args.modes:
                line = run_one(input_path, Path(tmp) / f"out-{mode}-{workers}", workers, mode, args)
                line["workers_per_prefix"] = _spread(Path(tmp) / f"out-{mode}-{workers}", prompt_of)
                line["hit_rate"] = round(line["cached_tokens"] / line["prompt_tokens"], 4)
                line["of_exact_ideal"] = round(line["cached_tokens"] / ideal, 4) if ideal else None
                results.append(line)
                print(json.dumps(line), flush=True)
    _table(results, ideal, total)
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results,
                                         "prompt_tokens": total, "exact_ideal_cached_tokens": ideal}, indent=1))


def _spread(out: Path, prompt_of: dict[str, str]) -> float:
    """Mean number of workers that ran rows of one prefix."""
    from jobrunner.io.parts import read_output

    table = read_output(str(out)).to_pydict()
    workers: dict[str, set] = {}
    for rid, worker in zip(table["id"], table["worker_id"], strict=True):
        workers.setdefault(prompt_of[rid].rsplit("\n\n", 1)[0], set()).add(worker)
    return round(sum(len(w) for w in workers.values()) / len(workers), 2)


def _table(results: list[dict], ideal: int, total: int) -> None:
    print(f"\nexact ideal: {ideal} of {total} prompt tokens cached ({100 * ideal / total:.1f}%)\n")
    print("| workers | sharding | hit rate | of ideal | computed prompt tokens | workers per prefix "
          "| busy s per worker | tokens/s (span) | tokens/s (wall) | prefix-aware / plain (span, wall) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    by_key = {(r["workers"], r["grouping"]): r for r in results}
    for r in results:
        plain = by_key.get((r["workers"], "off"))
        speedup = (f"{r['tokens_per_s_span'] / plain['tokens_per_s_span']:.2f}x, "
                   f"{r['tokens_per_s_wall'] / plain['tokens_per_s_wall']:.2f}x"
                   if plain and r["grouping"] == "auto" else "")
        busy = " / ".join(f"{v:.0f}" for v in r["worker_busy_s"].values())
        name = "prefix-aware" if r["grouping"] == "auto" else "plain"
        print(f"| {r['workers']} | {name} | {100 * r['hit_rate']:.1f}% | {100 * (r['of_exact_ideal'] or 0):.1f}% "
              f"| {r['computed_prompt_tokens']:,} | {r['workers_per_prefix']} | {busy} | {r['tokens_per_s_span']:,.0f} "
              f"| {r['tokens_per_s_wall']:,.0f} | {speedup} |")


if __name__ == "__main__":
    main()
