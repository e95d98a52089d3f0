"""`output.dedupe: prompts`: rows whose request repeats an earlier row's are written, not generated.

The driver finds them at planning (io/prompt_dupes.py: one pass over the input's request columns, the same
request fingerprint every output row carries) and stores the list under the output before any worker starts;
each worker marks the duplicates among a shard's requests (`DuplicateRows.mark`), and they become rows of
their own (driver/rows.py `error_row`: finish_reason `duplicate`, `dedupe_of` the first row's id, no error, no
tokens). Each input id still comes out exactly once, in the shard that holds it, so commits, retries and resume
are unchanged; the list depends only on the input, so every run and worker reads the same one. The manifest's
`dedupe` says how many rows, distinct prompts and duplicates the plan saw; the committed rows' finish reasons
(manifest totals and the report) count the `duplicate` rows written.
"""

from __future__ import annotations

import threading
from typing import Any

from jobrunner.driver.rows import RowRequest, fingerprint_roles, fingerprint_salt, id_column
from jobrunner.io.prompt_dupes import find_prompt_duplicates, read_duplicates, write_duplicates
from jobrunner.io.reader import InputFile
from jobrunner.io.storage import Storage
from jobrunner.spec import JobSpec

DEDUPE_KEY = "dedupe"  # manifest: the plan's rows, distinct prompts and duplicate prompts


def publish_duplicates(spec: JobSpec, files: list[InputFile], storage: Storage, manifest: dict[str, Any]) -> None:
    """Find the input's duplicate prompts and store them under the output (before any worker starts)."""
    if spec.output.dedupe != "prompts":
        return
    inp = spec.input
    found = find_prompt_duplicates(files, inp.storage_options, inp.format, id_column(spec),
                                   fingerprint_roles(spec), fingerprint_salt(spec))
    write_duplicates(storage, found)
    manifest[DEDUPE_KEY] = {"mode": "prompts", **found.describe()}


class DuplicateRows:
    """A worker's view of the stored duplicates, read once (the first shard that needs it)."""

    def __init__(self, spec: JobSpec, storage: Storage) -> None:
        self.is_on = spec.output.dedupe == "prompts"
        self._storage = storage
        self._first_of: dict[tuple[str, int], str] | None = None
        self._lock = threading.Lock()

    def mark(self, file_url: str, requests: list[RowRequest]) -> list[RowRequest]:
        """`requests` with each duplicate marked (dedupe_of and its error text set: it is not generated)."""
        if not self.is_on:
            return requests
        first_of = self._load()
        for req in requests:
            first = first_of.get((file_url, req.row_index))
            if first is not None and req.error is None:
                req.dedupe_of, req.error = first, f"duplicate of row {first!r}"
        return requests

    def _load(self) -> dict[tuple[str, int], str]:
        with self._lock:
            if self._first_of is None:
                self._first_of = read_duplicates(self._storage)
            return self._first_of
