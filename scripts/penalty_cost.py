"""Per-step cost of the sampling penalties: token counts rebuilt from the lists vs kept on the device.

    PYTHONPATH=. python scripts/penalty_cost.py [--rows 256] [--prompt 1024] [--output 900] [--vocab 128256]

Each row has a prompt of ``--prompt`` tokens and ``--output`` tokens already generated (1.9k tokens of context
by default, Llama-3's vocabulary), with repetition, presence and frequency penalties. Each timed step appends
one token per row, then penalizes a ``[rows, vocab]`` logits batch: *rebuild* counts every list afresh (what
the sampler did before, :func:`~jobrunner.engine.sampling.penalties.apply_penalties`); *incremental* adds the
new tokens to the device counts (:class:`~jobrunner.engine.sampling.token_counts.DeviceTokenCounts`). Both
runs' logits are checked equal. Prints one JSON line: median ms per step of each, split into the counting
part and the whole penalty step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from jobrunner.engine.request import Request
from jobrunner.engine.sampling import penalties
from jobrunner.engine.sampling.token_counts import DeviceTokenCounts
from jobrunner.engine.sampling_params import SamplingParams


def _requests(rows: int, prompt: int, output: int, vocab: int) -> list[Request]:
    rng = random.Random(0)
    params = SamplingParams(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)
    out = []
    for i in range(rows):
        r = Request(f"r{i}", [rng.randrange(vocab) for _ in range(prompt)], params, 0.0)
        r.output_token_ids = [rng.randrange(vocab) for _ in range(output)]
        out.append(r)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(mode: str, requests: list[Request], vocab: int, steps: int, device: torch.device):
    """(count ms per step, whole-step ms per step, the last step's logits)."""
    rows = list(range(len(requests)))
    n = len(rows)
    rep, pres, freq = [1.1] * n, [0.3] * n, [0.2] * n
    state = DeviceTokenCounts(device)
    count_ms, step_ms = [], []
    logits = None
    for step in range(steps + 1):       # step 0 fills the device counts once (not timed)
        for r in requests:
            r.output_token_ids.append((step * 7919 + len(r.output_token_ids)) % vocab)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(step)).to(device)
        _sync(device)
        t0 = time.perf_counter()
        if mode == "rebuild":
            out = penalties.token_counts([r.output_token_ids for r in requests], vocab, device)
            seen = out + penalties.token_counts([r.prompt_token_ids for r in requests], vocab, device)
        else:
            out, seen = state.counts(requests, vocab, True)
        _sync(device)
        t1 = time.perf_counter()
        penalties.apply_counted_penalties(logits, rows, out, seen, rep, pres, freq)
        _sync(device)
        t2 = time.perf_counter()
        if step:
            count_ms.append((t1 - t0) * 1e3)
            step_ms.append((t2 - t0) * 1e3)
    return statistics.median(count_ms), statistics.median(step_ms), logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=900)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    result = {"rows": args.rows, "context_tokens": args.prompt + args.output, "vocab": args.vocab,
              "device": str(device), "threads": torch.get_num_threads()}
    finals = {}
    for mode in ("rebuild", "incremental"):
        reqs = _requests(args.rows, args.prompt, args.output, args.vocab)
        count_ms, step_ms, finals[mode] = _run(mode, reqs, args.vocab, args.steps, device)
        result[mode] = {"count_ms": round(count_ms, 2), "penalty_step_ms": round(step_ms, 2)}
    result["equal_logits"] = bool(torch.equal(finals["rebuild"], finals["incremental"]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
