"""Stop-string cost before/after the incremental detokenizer (b48bc5c): the same greedy rows with stop strings
that never match (so the check runs every step) and without stop strings; output tok/s of each and the ratio.

It (and the helpers it takes from sampling_bench.py beside it) uses only engine API that every version since
ed662c2 has (EngineConfig, LLMEngine.from_source, generate, SamplingParams(max_tokens, temperature,
ignore_eos, stop), stats().to_dict()), so the same file runs against an old checkout:
whichever jobrunner is first on PYTHONPATH is measured.

    REPO=$PWD; git worktree add ../old-88a4d19 88a4d19    # old stop check (whole output re-decoded every step)
    cd ../old-88a4d19 && PYTHONPATH=$PWD $REPO/.venv/bin/python \\
        $REPO/scripts/stop_string_bench.py [--rows 8] [--max-tokens 1024]

b48bc5c's parent is 88a4d19, not ed662c2: ed662c2 has the same stopping.py but ~50 older commits elsewhere
(attention, rotary, decode graphs), so compare ratios (stop / no stop), not raw tok/s, across versions; a
worktree at 88a4d19 isolates the change best.

Prints one JSON object: the jobrunner checkout and commit it ran, per workload wall time, output tok/s and the
host time outside the model and scheduler (where the stop check runs), and stop/no-stop ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from sampling_bench import NEVER_STOP, PROMPTS_FILE, find_prompts, load_prompts, timed_generate  # scripts/

import jobrunner
from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

CHECKOUT = Path(jobrunner.__file__).resolve().parents[1]  # the jobrunner under test (may be another worktree)


def git_commit(root: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def build_engine(args) -> LLMEngine:
    config = dict(max_num_seqs=max(args.rows, 1), enable_prefix_caching=False, seed=0)
    if args.cuda_graphs != "default":  # its default was True in older versions, False now
        config["use_cuda_graphs"] = args.cuda_graphs == "on"
    if args.tiny:
        sys.path.insert(0, str(CHECKOUT / "tests" / "engine"))
        from tiny import engine_from_hf, make_hf_model, make_tokenizer

        return engine_from_hf(make_hf_model("llama"), make_tokenizer(), **config)
    return LLMEngine.from_source(args.model, config=EngineConfig(**config))


def run(engine: LLMEngine, prompts, params) -> tuple[dict, list[list[int]]]:
    outs, wall, before, after = timed_generate(engine, prompts, params)
    num_out = sum(len(o.output_token_ids) for o in outs)
    engine_s = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in ("prefill_s", "decode_s", "schedule_s"))
    return {"wall_s": wall, "output_tokens": num_out, "output_tok_s": num_out / wall,
            "host_outside_model_s": wall - engine_s,  # stop checks, detokenization, bookkeeping
            "steps": after["steps"] - before["steps"], "errors": sum(o.error is not None for o in outs),
            "finished_stop": sum(o.finish_reason == "stop" for o in outs)}, [list(o.output_token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="the random test model of the checkout under test")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=1, help="alternate no-stop / stop runs this many times")
    ap.add_argument("--prompts", type=Path, default=None, help=f"default: shared/data/{PROMPTS_FILE}")
    ap.add_argument("--cuda-graphs", choices=["off", "on", "default"], default="off",
                    help="EngineConfig.use_cuda_graphs (ignored on CPU); 'default': the version's own default")
    args = ap.parse_args()
    prompts = load_prompts(args.prompts or find_prompts(), args.rows)
    engine = build_engine(args)
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    stop = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, stop=NEVER_STOP)
    engine.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop=NEVER_STOP))
    runs: dict[str, list[dict]] = {"no_stop": [], "stop_strings": []}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, params in (("no_stop", plain), ("stop_strings", stop)):
            result, tokens[name] = run(engine, prompts, params)
            runs[name].append(result)
    median = {name: statistics.median(r["output_tok_s"] for r in rs) for name, rs in runs.items()}
    overhead = {name: statistics.median(r["host_outside_model_s"] for r in rs) for name, rs in runs.items()}
    result = {
        "checkout": str(CHECKOUT), "commit": git_commit(CHECKOUT), "model": "tiny" if args.tiny else args.model,
        "device": str(engine.device), "rows": len(prompts), "max_tokens": args.max_tokens,
        "repeats": args.repeats, "stop": NEVER_STOP,
        "no_stop": runs["no_stop"] if args.repeats > 1 else runs["no_stop"][0],
        "stop_strings": runs["stop_strings"] if args.repeats > 1 else runs["stop_strings"][0],
        "output_tok_s": median,
        "stop_over_no_stop": median["stop_strings"] / median["no_stop"],
        "extra_host_s_per_token": ((overhead["stop_strings"] - overhead["no_stop"])
                                   / max(1, runs["stop_strings"][0]["output_tokens"])),
        "same_tokens": tokens["no_stop"] == tokens["stop_strings"],  # greedy: the stop check changes nothing
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
