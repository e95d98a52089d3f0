"""What a shard writes besides its output rows: the part's table per output.format, and for OpenAI batch
input the OpenAI-style result lines (jobrunner.io.openai_files)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from jobrunner.driver.openai_batch import result_lines
from jobrunner.driver.rows import RowRequest, is_openai_batch
from jobrunner.io.openai_files import merge_openai_parts, write_openai_part
from jobrunner.io.parts import output_schema, rows_to_table
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.storage import Storage
from jobrunner.spec import JobSpec


def rows_table(spec: JobSpec, rows: list[dict[str, Any]], kept: pa.Table | None) -> pa.Table:
    """A shard's output rows (and kept input columns) as the part's table."""
    return rows_to_table(rows, kept, output_schema(spec.output.format))


def write_extra_files(spec: JobSpec, storage: Storage, shard_id: str, rows: list[dict[str, Any]],
                      requests: list[RowRequest]) -> None:
    """For an OpenAI batch job, the shard's output and error lines (before its part is committed)."""
    if not is_openai_batch(spec):
        return
    endpoint_of = {r.row_id: r.endpoint or "chat" for r in requests}
    in_order = sorted(rows, key=lambda r: r[ROW_INDEX])  # result lines in input order, like the batch file
    outputs, errors = result_lines(in_order, endpoint_of, spec.model.source, spec.name)
    write_openai_part(storage, shard_id, outputs, errors)


def finish_job_files(spec: JobSpec, storage: Storage, shard_ids: list[str]) -> list[str]:
    """When every shard is committed: merge the OpenAI result parts into one output and one error file."""
    if not is_openai_batch(spec):
        return []
    return merge_openai_parts(storage, shard_ids)
