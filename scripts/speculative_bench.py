"""Speculative decoding on/off (issue 18): acceptance, output tok/s and identical greedy rows at several batch sizes.

Two workloads from ../shared/data, greedy, EOS respected (rows finish at their own length, so every batch ends
in a drain tail):
- `copy`: "repeat / rewrite / extract from this text: ..." over GSM8K worked answers and longer ShareGPT
  prompts (the output copies runs of the prompt: n-gram drafts should be accepted);
- `chat`: open MT-Bench and ShareGPT questions (little to copy).

For each workload and batch size B (B rows, max_num_seqs = B) the same prompts run with `speculative` off, ngram
and auto, on one loaded model (one engine per setting over the same weights). With `--draft SOURCE` (a draft
model on the same tokenizer, e.g. one written by scripts/make_truncated_draft.py; `--draft-quantization int4`
quantizes it) two more modes exist: `draft` (the draft model, planned like auto) and `draft-always` (its drafts
verified every decode step). With `--repeats R` the modes run R times interleaved (off, ngram, auto, off, ngram,
auto, ...), each run's speed-up taken against the `off` run just before it, and the table shows the median over
the repeats (a shared machine drifts by 10-30% over a minute: back-to-back pairs and a median are what stand
up). Printed: one JSON line per run and a table: output tok/s, speed-up vs off, drafted / accepted tokens,
acceptance rate, steps, greedy rows identical to off.

Usage: python scripts/speculative_bench.py [--model smollm2-135m-instruct] [--batches 1,8,64] [--max-tokens 128]
       [--modes off,ngram,auto] [--workloads copy,chat] [--dtype auto] [--repeats 1]
       [--draft DIR --draft-quantization none --modes off,draft-always,draft]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
from jobrunner.engine.speculative.draft_model import DraftModel, load_draft

COPY_TEMPLATES = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text, keeping every number and step:\n\n{text}",
    "Extract every sentence of the following text that contains a number, quoting it exactly:\n\n{text}",
)


def find_data(name: str) -> Path:
    here = Path(__file__).resolve()
    for parent in here.parents[1:]:
        candidate = parent / "shared" / "data" / name
        if candidate.exists():
            return candidate
    raise SystemExit(f"no shared/data/{name} beside or above {here.parents[1]}")


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in find_data(name).read_text().splitlines() if line.strip()]


def copy_prompts(count: int) -> list[str]:
    """Prompts asking to repeat, rewrite or extract from a real text (GSM8K answers, long ShareGPT prompts)."""
    answers = [row["answer"].split("####")[0].strip() for row in _jsonl("gsm8k_test.jsonl")]
    long_chats = [row["prompt"] for row in _jsonl("sharegpt_v3_filtered_500.prompts.jsonl")
                  if 300 <= len(row["prompt"]) <= 1200]
    texts = [t for pair in zip(answers, long_chats) for t in pair]
    return [COPY_TEMPLATES[i % len(COPY_TEMPLATES)].format(text=texts[i]) for i in range(count)]


def chat_prompts(count: int) -> list[str]:
    """Open questions (MT-Bench turn 1, then short ShareGPT prompts)."""
    questions = [row["prompt"] for row in _jsonl("mt_bench_question.prompts.jsonl")]
    questions += [row["prompt"] for row in _jsonl("sharegpt_v3_filtered_500.prompts.jsonl") if len(row["prompt"]) < 300]
    return questions[:count]


def run_one(base: LLMEngine, mode: str, batch: int, prompts: list[str], max_tokens: int,
            draft: DraftModel | None = None) -> tuple[dict, list]:
    uses_draft = mode.startswith("draft")
    if uses_draft and draft is None:
        raise SystemExit(f"mode {mode} needs --draft")
    config = EngineConfig(max_num_seqs=batch, speculative=draft.source if uses_draft else mode,
                          device=base.config.device, enable_prefix_caching=False,
                          draft_every_step=mode == "draft-always")
    engine = LLMEngine(base.model, base.tokenizer, config, base.eos_token_ids, base.model_info,
                       draft=draft if uses_draft else None)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    engine.generate(messages[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up, untimed
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    before = engine.stats().to_dict()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(messages, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = engine.stats().to_dict()
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    out_tokens = sum(len(o.output_token_ids) for o in outs)
    result = {"mode": mode, "batch": batch, "rows": len(prompts), "output_tokens": out_tokens,
              "wall_s": round(wall, 3), "output_tok_s": round(out_tokens / wall, 2), "cpu_s": round(cpu, 3),
              "steps": after["steps"] - before["steps"], "drafted": drafted, "accepted": accepted,
              "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
              "speculative_rows": after["num_speculative_rows"] - before["num_speculative_rows"]}
    if engine.speculator is not None:
        result["policy"] = engine.speculator.stats()
    return result, [o.output_token_ids for o in outs]


def median_row(runs: list[dict]) -> dict:
    """One table row for a mode's repeats: medians of the rates, the first run's counts."""
    row = dict(runs[0])
    for key in ("output_tok_s", "speedup"):
        row[key] = statistics.median(r[key] for r in runs)
    row["speedups"] = [r["speedup"] for r in runs]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--modes", default="off,ngram,auto")
    ap.add_argument("--workloads", default="copy,chat")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rows-at-batch-1", type=int, default=2, help="rows run at batch 1 (one after the other)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repetitions; the table shows medians")
    ap.add_argument("--draft", default=None, help="a draft model source (modes draft, draft-always)")
    ap.add_argument("--draft-quantization", default="none")
    args = ap.parse_args()
    base = LLMEngine.from_source(args.model, dtype=args.dtype, config=EngineConfig(device="cpu"))
    draft = None
    if args.draft:
        draft = load_draft(args.draft, base.model, EngineConfig(draft_quantization=args.draft_quantization))
    print(json.dumps({"model": args.model, "dtype": str(base.model.dtype), "draft": args.draft,
                      "draft_quantization": args.draft_quantization}), flush=True)
    run_one(base, "off", 8, chat_prompts(8), 16)  # untimed: the first run of a process pays page faults
    table = []
    for workload in args.workloads.split(","):
        make = copy_prompts if workload == "copy" else chat_prompts
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = make(max(batch, args.rows_at_batch_1 if batch == 1 else batch))
            runs: dict[str, list[dict]] = {}
            for _ in range(args.repeats):
                reference = None
                for mode in args.modes.split(","):
                    result, tokens = run_one(base, mode, batch, prompts, args.max_tokens, draft)
                    if reference is None:
                        reference, off_tok_s = tokens, result["output_tok_s"]
                    result.update(workload=workload, identical_rows=sum(a == b for a, b in zip(tokens, reference)),
                                  speedup=round(result["output_tok_s"] / off_tok_s, 3))
                    print(json.dumps(result), flush=True)
                    runs.setdefault(mode, []).append(result)
            table.extend(median_row(rs) for rs in runs.values())
    print("\n| workload | batch | mode | output tok/s | vs off | drafted | accepted | acceptance | steps | "
          "greedy rows identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        rate = "—" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        each = "" if len(r["speedups"]) < 2 else " (" + " ".join(f"{x:.2f}" for x in r["speedups"]) + ")"
        print(f"| {r['workload']} | {r['batch']} | {r['mode']} | {r['output_tok_s']:.1f} | {r['speedup']:.2f}x{each} | "
              f"{r['drafted']} | {r['accepted']} | {rate} | {r['steps']} | {r['identical_rows']}/{r['rows']} |")


if __name__ == "__main__":
    main()
