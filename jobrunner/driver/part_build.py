"""A shard's part table, built so that one unbuildable row never fails its shard.

Building the table can fail outside the engine for one row: a generated text or logprobs list too large for
one Arrow array (ArrowCapacityError), MemoryError, a value Arrow refuses. The rows are then built in halves
(joined as chunks of one table, which also lifts the 2 GiB limit of a single string array) until the
failing row is alone; it becomes an error row naming the exception and keeping its id and token counts.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from jobrunner.driver.isolation import IsolationCost
from jobrunner.driver.output_files import rows_table
from jobrunner.io.reader import ROW_INDEX
from jobrunner.spec import JobSpec

ROW_BUILD_ERRORS = (MemoryError, OverflowError, pa.ArrowCapacityError, pa.ArrowInvalid, pa.ArrowTypeError,
                    pa.ArrowMemoryError)
_KEPT_KEYS = ("id", "sample_index", "prompt_shared", "num_prompt_tokens", "num_cached_tokens",
              "num_output_tokens", "shard_id", "worker_id", "finish_time_s", "request_fingerprint")


def part_table(spec: JobSpec, rows: list[dict[str, Any]], kept: pa.Table | None, cost: IsolationCost) -> pa.Table:
    """The part's table of `rows` (see the module doc); a row that cannot be stored is replaced in place by its
    error row, and counted in `cost.rows_isolated`."""
    try:
        return rows_table(spec, rows, kept)
    except ROW_BUILD_ERRORS as exc:
        if len(rows) <= 1:
            if not rows:
                raise
            cost.rows_isolated += 1
            replacement = unbuildable_row(rows[0], exc)
            rows[0].clear()
            rows[0].update(replacement)  # the shard's own row dict: the summary counts it as an error
            return rows_table(spec, rows, kept)
    mid = len(rows) // 2
    return pa.concat_tables([part_table(spec, rows[:mid], kept, cost), part_table(spec, rows[mid:], kept, cost)])


def unbuildable_row(row: dict[str, Any], exc: BaseException) -> dict[str, Any]:
    """An error row in place of a row that cannot be stored (its id, index and counts kept)."""
    out = {k: row.get(k) for k in _KEPT_KEYS if k in row}
    out[ROW_INDEX] = row.get(ROW_INDEX)
    out.update(generated_text=None, finish_reason="error",
               error=f"could not store the output row: {type(exc).__name__}: {str(exc)[:300]}")
    return out
