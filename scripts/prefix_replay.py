"""Computed prompt tokens of prefix-aware vs plain sharding, replayed without a model (issue 18, item 1).

Runs the real scheduler and KV-cache manager (engine/scheduler.py, engine/kv_cache/) over the tokenized
workloads of scripts/prefix_bench.py, with every step's tokens taken as computed and `--max-tokens` dummy
output tokens per row: what the prefix cache saves, on any number of workers, in seconds instead of the
minutes a real run takes on this machine. Approximations (say so when quoting it): plain = the shuffled rows
in `--rows-per-shard` row ranges dealt round-robin; prefix-aware = the rows sorted by prompt, one contiguous
run per worker (the planner's trie order and dealing, without stealing); each worker's rows all queued at
once. KV cache = the engine's CPU default (2 GiB) unless `--kv-mib`. No timing: tokens/s needs prefix_bench.

    PYTHONPATH=. .venv/bin/python scripts/prefix_replay.py --workload sampled --prefixes 96 --workers 1 2 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from jobrunner.engine.config import EngineConfig
from jobrunner.engine.kv_cache.manager import KVCacheManager
from jobrunner.engine.request import Request, RequestStatus
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.engine.scheduler import Scheduler

BENCH = Path(__file__).resolve().parent / "prefix_bench.py"
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M bf16: K and V x 30 layers x 3 KV heads x 64 dims


def replay_worker(prompts: list[list[int]], num_blocks: int, args: argparse.Namespace) -> int:
    """Cached prompt tokens when one worker's engine runs these prompts in this order."""
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, args.block_size))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    requests = [Request(f"r{i}", ids, params, 0.0) for i, ids in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        for item in out.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
            if item.samples:
                item.request.output_token_ids.append(0)
        for item in out.scheduled:
            if item.request.num_output_tokens >= args.max_tokens:
                scheduler.finish(item.request, RequestStatus.FINISHED_LENGTH)
    return sum(r.metrics.num_cached_tokens for r in requests)


def computed(rows: list[tuple[str, list[int]]], workers: int, grouped: bool, num_blocks: int,
             args: argparse.Namespace) -> int:
    """Computed prompt tokens over all workers: (prompt text, token ids) rows in input order."""
    if grouped:
        ordered = [ids for _, ids in sorted(rows, key=lambda r: r[0])]
        per = [ordered[len(ordered) * w // workers:len(ordered) * (w + 1) // workers] for w in range(workers)]
    else:
        step = args.rows_per_shard
        shards = [[ids for _, ids in rows[i:i + step]] for i in range(0, len(rows), step)]
        per = [[ids for shard in shards[w::workers] for ids in shard] for w in range(workers)]
    total = sum(len(ids) for _, ids in rows)
    return total - sum(replay_worker(p, num_blocks, args) for p in per)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["rotated", "sampled"], default="sampled")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prefixes", type=int, default=96)
    parser.add_argument("--rows-per-prefix", type=int, nargs=2, default=[2, 8])
    parser.add_argument("--shots", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--rows-per-shard", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=2048, help="KV cache per worker (MiB); engine default 2048")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("prefix_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if args.workload == "sampled":
        rows = bench.sampled_workload(args.prefixes, tuple(args.rows_per_prefix), args.shots, args.seed)
    else:
        rows = bench.workload(args.rows, args.prefixes, args.seed)
    tokenizer = bench.tokenizer()
    tokenized = [(prompt, tokenizer(prompt)["input_ids"]) for _, prompt in rows]
    total, ideal = bench.exact_ideal([p for _, p in rows], args.block_size)
    num_blocks = args.kv_mib * 1024 * 1024 // (KV_BYTES_PER_TOKEN * args.block_size)
    print(json.dumps({"workload": args.workload, "rows": len(rows), "prompt_tokens": total,
                      "ideal_computed": total - ideal, "kv_cache_tokens": num_blocks * args.block_size}))
    for workers in args.workers:
        aware = computed(tokenized, workers, True, num_blocks, args)
        plain = computed(tokenized, workers, False, num_blocks, args)
        print(json.dumps({"workers": workers, "computed_prefix_aware": aware, "computed_plain": plain,
                          "aware_of_ideal": round((total - aware) / ideal, 4),
                          "plain_of_ideal": round((total - plain) / ideal, 4),
                          "plain_over_aware": round(plain / aware, 2)}), flush=True)


if __name__ == "__main__":
    main()
