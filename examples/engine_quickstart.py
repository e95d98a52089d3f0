"""The engine alone, as in a notebook: only torch + transformers are needed.

    .venv/bin/python examples/engine_quickstart.py
"""

from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams

QUESTIONS = [
    "What is 7 * 6? Answer with the number only.",
    "Name three primary colours.",
    "Write a haiku about batch inference.",
]


def main() -> None:
    engine = LLMEngine.from_source("smollm2-135m-instruct", config=EngineConfig(max_num_seqs=16))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = engine.generate(chats, SamplingParams(max_tokens=48, temperature=0), use_tqdm=True)
    for question, out in zip(QUESTIONS, outputs):
        m = out.metrics
        print(f"Q: {question}\nA: {out.text.strip()}\n   [{out.finish_reason}] ttft {m.ttft_s:.2f}s, "
              f"{m.num_output_tokens} tokens, itl {m.itl_mean_s or 0:.3f}s\n")
    print(engine.stats().to_dict())


if __name__ == "__main__":
    main()
