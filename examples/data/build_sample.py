"""Rebuild examples/data/prompts.parquet from the public prompt sets (run once by a maintainer).

Not used at run time: the committed Parquet file is what jobs read. Sources and licences: README.md here.
Usage: python examples/data/build_sample.py /path/to/shared/data
"""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

NUM_GSM8K, NUM_MT_BENCH = 48, 16


def _prompts(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    return [r["prompt"] for r in rows]


def main(data_dir: str) -> None:
    src = Path(data_dir)
    gsm = _prompts(src / "gsm8k_test.prompts.jsonl", NUM_GSM8K)
    mt = _prompts(src / "mt_bench_question.prompts.jsonl", NUM_MT_BENCH)
    ids = [f"gsm8k-{i:04d}" for i in range(len(gsm))] + [f"mt_bench-{i:04d}" for i in range(len(mt))]
    sources = ["gsm8k_test"] * len(gsm) + ["mt_bench_question"] * len(mt)
    prompts = gsm + mt
    # The same text as a one-turn chat, for jobs that use messages_column (the chat template is applied).
    messages = [[{"role": "user", "content": p}] for p in prompts]
    table = pa.table({"id": ids, "prompt": prompts, "messages": messages, "source": sources})
    out = Path(__file__).with_name("prompts.parquet")
    pq.write_table(table, out, row_group_size=16, compression="zstd")
    print(f"wrote {out}: {table.num_rows} rows")


if __name__ == "__main__":
    main(sys.argv[1])
