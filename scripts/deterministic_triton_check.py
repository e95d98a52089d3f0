"""engine.deterministic on the triton backend under Triton's CPU interpreter (a check, not a timed test).

Tiny random-weight model in float32, 3 seeded sampled rows x 6 tokens with logprobs, run at max_num_seqs 64 /
2048-token budget and at max_num_seqs 1 / 8-token budget (chunked prefill, decode-only steps): counts the rows
whose tokens or logprob bits differ, with deterministic on and off. Deterministic mode keeps one tile height
for every step (TritonBackend.fixed_tiles), so every step runs the same compiled kernel.

Usage: PYTHONPATH=. python scripts/deterministic_triton_check.py   (sets TRITON_INTERPRET=1 itself)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from tiny import CORPUS, make_hf_model, make_tokenizer  # noqa: E402

from jobrunner.engine import EngineConfig, SamplingParams  # noqa: E402
from jobrunner.engine.llm_engine import LLMEngine  # noqa: E402
from jobrunner.models.loader import build_model, load_weights  # noqa: E402


def main() -> None:
    tok, hf = make_tokenizer(), make_hf_model("llama")
    prompts = [CORPUS[0] + " " + CORPUS[i] for i in range(1, 4)]
    ps = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7 + i, logprobs=0) for i in range(3)]

    def rows(deterministic: bool, **config):
        model = build_model(hf.config, torch.float32, torch.device("cpu"))
        load_weights(model, hf.state_dict().items())
        engine = LLMEngine(model, tok, EngineConfig(attention_backend="triton", num_kv_blocks=128,
                                                    deterministic=deterministic, **config), eos_token_ids=[2])
        assert engine.runner.backend.name == "triton"
        return [(o.output_token_ids, [lp.logprob for lp in o.logprobs]) for o in engine.generate(prompts, ps)]

    for deterministic in (True, False):
        a, b = rows(deterministic), rows(deterministic, max_num_seqs=1, max_num_batched_tokens=8)
        print("deterministic" if deterministic else "default",
              f"triton (interpreter): rows with other tokens {sum(x[0] != y[0] for x, y in zip(a, b))}, "
              f"other logprob bits {sum(x[1] != y[1] for x, y in zip(a, b))}, of {len(a)}")


if __name__ == "__main__":
    main()
