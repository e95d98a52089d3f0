"""Per-step cost of the sampling penalties: token counts rebuilt from the lists vs kept on the device.

    PYTHONPATH=. python scripts/penalty_cost.py [--rows 256] [--prompt 1024] [--output 900] [--vocab 128256]

Each row has a prompt of ``--prompt`` tokens and ``--output`` tokens already generated (1.9k tokens of context
by default, Llama-3's vocabulary), with repetition, presence and frequency penalties. Each timed step appends
one token per row, then penalizes a ``[rows, vocab]`` logits batch: *rebuild* counts every list afresh (what
the sampler did before, :func:`~jobrunner.engine.sampling.penalties.apply_penalties`); *incremental* adds the
new tokens to the device state and penalizes only the ids each row holds
(:class:`~jobrunner.engine.sampling.token_counts.DevicePenaltyState`). Both runs' logits are checked equal.
Prints one JSON line: the median ms per step of each (the whole penalty step: counting and applying).
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
from jobrunner.engine.sampling.token_counts import DevicePenaltyState
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
    """(median ms per penalty step, the last step's logits)."""
    rows = list(range(len(requests)))
    n = len(rows)
    rep, pres, freq = [1.1] * n, [0.3] * n, [0.2] * n
    state = DevicePenaltyState(device)
    step_ms = []
    logits = None
    for step in range(steps + 1):       # step 0 fills the device state once (not timed)
        for r in requests:
            r.output_token_ids.append((step * 7919 + len(r.output_token_ids)) % vocab)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(step)).to(device)
        _sync(device)
        t0 = time.perf_counter()
        if mode == "rebuild":
            penalties.apply_penalties(logits, rows, [r.prompt_token_ids for r in requests],
                                      [r.output_token_ids for r in requests], rep, pres, freq)
        else:
            state.apply(logits, rows, requests, rep, pres, freq)
        _sync(device)
        if step:
            step_ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(step_ms), logits


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
        step_ms, finals[mode] = _run(mode, reqs, args.vocab, args.steps, device)
        result[mode] = {"penalty_step_ms": round(step_ms, 2)}
    result["equal_logits"] = bool(torch.equal(finals["rebuild"], finals["incremental"]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
