"""Per-step token-mask cost of the structured-output libraries (xgrammar, llguidance, outlines-core).

Walks one JSON-schema-constrained generation per library: every step fills the next-token bitmask, then takes
a random allowed token. Reports compile time and the mean fill time per step (what a constrained row adds to
every decode step). Usage: python scripts/grammar_overhead.py [TOKENIZER_DIR] [--steps N]
(default tokenizer: the SmolLM2 alias in the jobrunner cache).

``--rows N`` instead measures the engine's own structured-output step at N constrained rows: the sampler's
logits processing (``Sampler._process``: fill the grammar masks, move them to the logits' device, mask) per
step, over ``--steps`` steps where every row samples a random allowed token (rows whose grammar ends restart
with a fresh request). It also times the bare xgrammar fills of the same rows (the inherent floor) and, where
the sampler has them, counts the mask rows filled. ``--device cuda`` runs the logits on the GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = bitmask_row.view(torch.int32).numpy()
    ids = [w * 32 + b for w in range(len(bits)) for b in range(32) if (int(bits[w]) >> b) & 1]
    return [i for i in ids if i < vocab]


def walk(fill, accept, done, vocab: int, steps: int, bitmask: torch.Tensor) -> tuple[float, int]:
    rng = random.Random(0)
    spent, n = 0.0, 0
    for _ in range(steps):
        if done():
            break
        t0 = time.perf_counter()
        fill(bitmask)
        spent += time.perf_counter() - t0
        n += 1
        accept(rng.choice(allowed_ids(bitmask[0], vocab)))
    return spent / max(n, 1), n


def run_xgrammar(tok, vocab: int, steps: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    per, n = walk(lambda b: m.fill_next_token_bitmask(b, 0), m.accept_token, m.is_terminated, vocab, steps, mask)
    return {"compile_s": compile_s, "fill_us": per * 1e6, "steps": n}


def run_llguidance(tok, vocab: int, steps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}))
    compile_s = time.perf_counter() - t0
    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    per, n = walk(lambda b: llguidance.torch.fill_next_token_bitmask(m, b, 0), m.consume_token,
                  m.is_stopped, vocab, steps, mask)
    return {"compile_s": compile_s, "fill_us": per * 1e6, "steps": n}


def run_outlines(tok, vocab: int, steps: int) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    token_map: dict[str, list[int]] = {}
    for token, i in tok.get_vocab().items():
        if i != tok.eos_token_id:
            token_map.setdefault(token, []).append(i)
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(tok.eos_token_id, token_map))
    compile_s = time.perf_counter() - t0
    guide = Guide(index)
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)

    def fill(b: torch.Tensor) -> None:
        guide.write_mask_into(b.data_ptr(), b.numel(), b.element_size())

    per, n = walk(fill, guide.advance, guide.is_finished, vocab, steps, mask)
    return {"compile_s": compile_s, "fill_us": per * 1e6, "steps": n}


def run_engine_rows(tok, vocab: int, steps: int, num_rows: int, device: str) -> dict:
    """Per-step cost of the engine's grammar masking at ``num_rows`` constrained rows (see the module doc)."""
    from jobrunner.engine import SamplingParams
    from jobrunner.engine.request import Request
    from jobrunner.engine.sampler import Sampler
    from jobrunner.engine.sampling.structured import GrammarCompiler

    dev = torch.device(device)
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    params = SamplingParams(json_schema=SCHEMA, temperature=1.0)
    factory = compiler.factory(params)
    made = iter(range(10 ** 9))

    def fresh() -> Request:
        r = Request(f"r{next(made)}", [1, 2, 3], params, 0.0)
        r.grammar = factory()
        return r

    sampler, rng = Sampler(dev), random.Random(0)
    requests = [fresh() for _ in range(num_rows)]
    floor_mask = compiler._xgr.allocate_token_bitmask(num_rows, vocab)
    spent = floor = 0.0
    for step in range(steps + 5):                       # the first 5 steps warm up (allocations, kernels)
        logits = torch.randn(num_rows, vocab, device=dev)
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            r.grammar.fill(floor_mask, i)
        t1 = time.perf_counter()
        sampler._process(logits, requests)
        host = logits.cpu()                            # the sampler's one device->host transfer happens later
        t2 = time.perf_counter()
        if step >= 5:
            floor, spent = floor + (t1 - t0), spent + (t2 - t1)
        for i, r in enumerate(requests):
            allowed = torch.isfinite(host[i]).nonzero().flatten().tolist()
            r.grammar.accept(rng.choice(allowed))
            r.output_token_ids.append(0)
            if r.grammar.is_terminated:
                sampler.release(r.key)
                requests[i] = fresh()
    masks = getattr(sampler, "grammar_masks", None)
    return {"rows": num_rows, "device": device, "steps": steps, "mask_step_us": spent / steps * 1e6,
            "bare_fill_us": floor / steps * 1e6,
            "rows_filled_per_step": None if masks is None else masks.num_fills / (steps + 5)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer", nargs="?", default=str(Path("~/.cache/jobrunner/models/smollm2-135m-instruct")
                                                         .expanduser()))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rows", type=int, default=0, help="measure the engine's masking step at this many rows")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = len(tok)
    if args.rows:
        print(json.dumps(run_engine_rows(tok, vocab, args.steps, args.rows, args.device), indent=1))
        return
    out = {"tokenizer": args.tokenizer, "vocab": vocab}
    for name, fn in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance), ("outlines_core", run_outlines)):
        try:
            out[name] = fn(tok, vocab, args.steps)
        except Exception as exc:  # report a library that fails instead of stopping the comparison
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
