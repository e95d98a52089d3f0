"""Rebuild the JSONL examples (run once by a maintainer; jobs read the committed files).

- `gsm8k_64.jsonl`: the first 64 GSM8K test questions as one-turn chats, with the gold answer (after `####`):
  {"id", "messages", "answer"}.
- `openai_batch.jsonl`: 8 requests in the OpenAI batch input layout (GSM8K and MT-Bench questions), using
  the body fields jobs honour per request (n, logprobs, response_format, stop, seed, completions).
Usage: python examples/data/build_jsonl.py /path/to/shared/data
"""

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 10**9}},
                 "required": ["answer"], "additionalProperties": False}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _chat(custom_id: str, question: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": question}],
                     **body}}


def main(data_dir: str) -> None:
    src = Path(data_dir)
    gsm = _jsonl(src / "gsm8k_test.jsonl")[:64]
    rows = [{"id": f"gsm8k-{i:04d}", "messages": [{"role": "user", "content": r["question"]}],
             "answer": r["answer"].rsplit("####", 1)[-1].strip()} for i, r in enumerate(gsm)]
    (HERE / "gsm8k_64.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mt = [r["prompt"] for r in _jsonl(src / "mt_bench_question.prompts.jsonl")[:3]]
    q = [r["question"] for r in gsm[:5]]
    requests = [
        _chat("gsm8k-0000", q[0], max_completion_tokens=64, temperature=0),
        _chat("gsm8k-0001", q[1], max_tokens=64, temperature=0.8, n=3, seed=1),
        _chat("gsm8k-0002", q[2], max_tokens=32, temperature=0, logprobs=True, top_logprobs=3),
        _chat("gsm8k-0003", q[3] + " Reply in JSON.", max_tokens=32, temperature=0,
              response_format={"type": "json_schema",
                               "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}),
        _chat("gsm8k-0004", q[4], max_tokens=48, temperature=0.7, top_p=0.9, stop=["\n\n"], seed=7,
              presence_penalty=0.5),
        _chat("mt_bench-0000", mt[0], max_tokens=64, temperature=0, frequency_penalty=0.3),
        _chat("mt_bench-0001", mt[1], max_tokens=64, temperature=0,
              messages=[{"role": "system", "content": "Answer in one short paragraph."},
                        {"role": "user", "content": mt[1]}]),
        {"custom_id": "mt_bench-0002", "method": "POST", "url": "/v1/completions",
         "body": {"model": "smollm2-135m-instruct", "prompt": mt[2], "max_tokens": 32, "temperature": 0,
                  "logprobs": 2}},
    ]
    (HERE / "openai_batch.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    print(f"wrote {len(rows)} rows to gsm8k_64.jsonl, {len(requests)} requests to openai_batch.jsonl")


if __name__ == "__main__":
    main(sys.argv[1])
