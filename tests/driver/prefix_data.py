"""Prompt files whose rows share a few prefixes, shuffled so rows of one prefix are not contiguous."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq


def prefix_head(group: int) -> str:
    """A long shared prefix; groups differ in their first words (and in word lengths, the fake engine's
    tokens)."""
    return f"{'x' * (group + 1)} system {group}: " + "answer briefly and exactly please " * 8


def write_prefix_prompts(path, num_rows: int, num_groups: int, row_group_size: int = 16,
                         seed: int = 0) -> list[tuple[str, str]]:
    """A shuffled Parquet file of (id, prompt) rows, row i in group i % num_groups; returns the rows in
    file order."""
    rows = [(f"p{i:04d}", prefix_head(i % num_groups) + f"question {i} " + "w" * (i % 7 + 1))
            for i in range(num_rows)]
    random.Random(seed).shuffle(rows)
    table = pa.table({"id": [r[0] for r in rows], "prompt": [r[1] for r in rows],
                      "topic": [f"t{int(r[0][1:]) % 3}" for r in rows]})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return rows


def group_of(prompt: str) -> int:
    """The group a prompt of `write_prefix_prompts` belongs to."""
    return len(prompt.split(" ", 1)[0]) - 1
