"""What a job writes besides its rows: the part's table per output.format, and for OpenAI batch input the
OpenAI-style result files (jobrunner.io.openai_files), built by the driver from the committed parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from jobrunner.driver.openai_batch import ENDPOINTS, result_lines
from jobrunner.driver.rows import OPENAI_ID_COLUMN, is_openai_batch, job_output_schema
from jobrunner.io.openai_files import read_result_rows, write_openai_results
from jobrunner.io.parts import rows_to_table
from jobrunner.io.reader import ROW_INDEX
from jobrunner.io.storage import Storage
from jobrunner.io.text_input import list_input, read_input_rows
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec


def rows_table(spec: JobSpec, rows: list[dict[str, Any]], kept: pa.Table | None) -> pa.Table:
    """A shard's output rows (and kept input columns) as the part's table."""
    return rows_to_table(rows, kept, job_output_schema(spec))


def finish_job_files(spec: JobSpec, storage: Storage, part_keys: list[str]) -> list[str]:
    """When every shard is committed (`part_keys`: their committed parts), whatever the error budget: an
    OpenAI batch job's output and error files, in input order."""
    if not is_openai_batch(spec):
        return []
    requests = _requests_in_order(spec)
    rows = read_result_rows(storage, part_keys)
    for row in rows:
        row["_status"] = error_status(row)
    rows.sort(key=lambda r: (requests.position.get(r["id"], len(requests.position)), r["sample_index"] or 0))
    outputs, errors = result_lines(rows, requests.endpoint_of, redact_text(spec.model.source), spec.name,
                                   unnamed=requests.unnamed)
    return write_openai_results(storage, outputs, errors)


@dataclass
class _Requests:
    """What the result files need of the batch files: custom_id -> position in the input and endpoint
    ("chat" / "completions"); `unnamed`: the ids given to lines whose custom_id could not be read."""

    position: dict[str, int] = field(default_factory=dict)
    endpoint_of: dict[str, str] = field(default_factory=dict)
    unnamed: set[str] = field(default_factory=set)


def _requests_in_order(spec: JobSpec) -> _Requests:
    inp = spec.input
    out = _Requests()
    for f in list_input(inp.url, inp.storage_options, inp.format):
        table = read_input_rows(f.url, inp.storage_options, inp.format, 0, f.num_rows, [OPENAI_ID_COLUMN, "url"])
        for row in table.to_pylist():
            rid = row[OPENAI_ID_COLUMN]
            if rid is None:
                rid = f"{f.stem}:{row[ROW_INDEX]}"
                out.unnamed.add(rid)
            out.position.setdefault(rid, len(out.position))
            out.endpoint_of.setdefault(rid, ENDPOINTS.get(row["url"], "chat"))
    return out


def error_status(row: dict[str, Any]) -> int:
    """HTTP-like status of a row: 200; 400 for a request refused before generating anything (bad request,
    prompt too long); 500 for a failure after generation started."""
    if row.get("error") is None:
        return 200
    return 500 if row.get("num_output_tokens") or row.get("ttft_s") is not None else 400
