"""Each row's sampling seed: synthetic data from one `sampling.seed` without identical samples for identical
prompts.

With one seed for every row, two rows with the same prompt draw the same noise and give the same text: a
synthetic-data job that repeats a prompt to get variety gets copies instead. So the job's seed is a seed *of
the job*: each row samples with `row_seed(sampling.seed, row id)`, its own stream, the same on every retry,
resume or worker (the row id never changes), so `engine.deterministic` still gives byte-identical datasets.
`sampling.seed_per_row: false` keeps one seed for every row (the behaviour before this setting); a
`sampling.seed_column` gives rows their own seeds outright (a null there falls back to the job's rule); a seed
a row asks for itself (`input.sampling_column`, an OpenAI batch line's `seed`) is taken as written.
"""

from __future__ import annotations

import hashlib
from typing import Any

from jobrunner.engine.sampling_params import SamplingParams

_MAX_SEED = (1 << 63) - 1


def row_seed(job_seed: int, row_id: str) -> int:
    """The seed of one row: a 63-bit hash of the job's seed and the row's id (stable across processes)."""
    digest = hashlib.blake2b(f"{int(job_seed)}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MAX_SEED


def column_seed(value: Any, column: str, row_id: str) -> int | None:
    """A seed column's value as a seed (None for null); ValueError names the column and the row."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"sampling.seed_column {column!r}: row {row_id!r} has {value!r}, not an integer seed")
    try:
        seed = int(value) if not isinstance(value, float) or value.is_integer() else None
    except ValueError:
        seed = None
    if seed is None or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"sampling.seed_column {column!r}: row {row_id!r} has {value!r}, not an integer seed in "
                         f"0..2**63-1")
    return seed


def seeded(sampling: Any, params: SamplingParams, row: dict[str, Any], row_id: str,
           asked_seed: bool) -> SamplingParams:
    """`params` of one row with the row's seed: its seed column's value, else (unless the row asked for a seed
    itself, `asked_seed`) the job's seed derived per row; `sampling` is the job's SamplingSpec."""
    column = sampling.seed_column
    if column:
        seed = column_seed(row.get(column), column, row_id)
        if seed is not None:
            return params.with_overrides({"seed": seed})
    if asked_seed or params.seed is None or sampling.seed_per_row is False:
        return params
    return params.with_overrides({"seed": row_seed(params.seed, row_id)})


def seed_rule(sampling: dict[str, Any]) -> str | None:
    """How a written spec's rows were seeded, for the resume check: None without any seed, else 'per row' or
    'job' (one seed for all). A spec written before `seed_per_row` existed seeded every row with the job's."""
    if sampling.get("seed") is None and not sampling.get("seed_column"):
        return None
    if "seed_per_row" not in sampling:
        return "job"
    return "job" if sampling["seed_per_row"] is False else "per row"
