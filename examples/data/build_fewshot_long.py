"""Rebuild `gsm8k_fewshot_long.jsonl`: the long shared-prefix benchmark set (run once by a maintainer).

72 GSM8K test questions behind 10 distinct few-shot headers of 11 solved examples each (~1.2 k tokens a
prompt on SmolLM2's tokenizer): each header holds the 8 chain-of-thought exemplars of the GSM8K 8-shot set and
3 solved GSM8K test problems (question, the gold worked answer with its calculator marks removed, "The answer is
N."), in an order of its own. Rows of one header share a long prefix, so the set measures prefix caching and
prefix-aware admission, and attention over ~1 k-token contexts. Rows: {"id", "prompt", "prefix"}.
Usage: python examples/data/build_fewshot_long.py /path/to/shared/data
"""

import json
import random
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent
NUM_PREFIXES, SOLVED_PER_PREFIX = 10, 3
NUM_ROWS = 72  # row i behind header i % 10: 8 rows on headers 0 and 1, 7 on the others


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _exemplars(eight_shot_prompt: str) -> list[str]:
    """The 8 `Q: ...\\nA: ...` exemplars in front of the first 8-shot prompt (the last block is the question)."""
    blocks = eight_shot_prompt.split("\n\n")
    return [b for b in blocks if b.startswith("Q: ") and "\nA: " in b][:8]


def _solved(row: dict) -> str:
    """One GSM8K test problem as a solved exemplar: the gold worked answer without its <<calc>> marks."""
    work, answer = row["answer"].rsplit("####", 1)
    work = re.sub(r"<<[^>]*>>", "", work).strip().replace("\n", " ")
    return f"Q: {row['question']}\nA: {work} The answer is {answer.strip()}."


def main(data_dir: str) -> None:
    src = Path(data_dir)
    exemplars = _exemplars(_jsonl(src / "gsm8k_test_8shot_cot.prompts.jsonl")[0]["prompt"])
    gsm = _jsonl(src / "gsm8k_test.jsonl")
    rng = random.Random(0)
    solved_pool = gsm[-NUM_PREFIXES * SOLVED_PER_PREFIX:]  # the last problems: never asked as questions below
    headers = []
    for p in range(NUM_PREFIXES):
        blocks = exemplars + [_solved(r) for r in solved_pool[p * SOLVED_PER_PREFIX:(p + 1) * SOLVED_PER_PREFIX]]
        rng.shuffle(blocks)
        headers.append("\n\n".join(blocks))
    rows = []
    for i, q in enumerate(gsm[:NUM_ROWS]):
        p = i % NUM_PREFIXES
        rows.append({"id": f"fewshot-{i:03d}", "prefix": p, "prompt": f"{headers[p]}\n\nQ: {q['question']}\nA:"})
    (HERE / "gsm8k_fewshot_long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(HERE.parents[1].parent / "shared" / "data"))
