"""Build the long few-shot prompt set of docs/bench.md (*Zen 4 without AMX*) from the GSM8K files of the shared
prompt sets: row i is the 8-shot chain-of-thought prompt of row i with six worked GSM8K test problems (rows
200 + 6 i .. 200 + 6 i + 5, with their gold solutions) put before its question, ~1,980 tokens a row, the
8 exemplars (~730 tokens) shared by every row.

usage: python scripts/long_fewshot.py SHARED_DATA_DIR OUT.jsonl [ROWS]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def build(data: Path, rows: int) -> list[dict[str, str]]:
    """The set's rows, ``{"prompt": text}`` each."""
    prompts = [json.loads(line)["prompt"] for line in open(data / "gsm8k_test_8shot_cot.prompts.jsonl")]
    solved = [json.loads(line) for line in open(data / "gsm8k_test.jsonl")]
    out = []
    for i in range(rows):
        shots = [solved[(200 + 6 * i + j) % len(solved)] for j in range(6)]
        worked = "".join(f"Q: {s['question']}\nA: {s['answer'].split('####')[0].strip()} The answer is "
                         f"{s['answer'].split('####')[1].strip()}.\n\n" for s in shots)
        prompt = prompts[i]
        question = prompt.rfind("Q: ")
        out.append({"prompt": prompt[:question] + worked + prompt[question:]})
    return out


if __name__ == "__main__":
    data, target = Path(sys.argv[1]), Path(sys.argv[2])
    rows = build(data, int(sys.argv[3]) if len(sys.argv) > 3 else 64)
    target.write_text("".join(json.dumps(r) + "\n" for r in rows))
