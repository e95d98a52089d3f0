"""`output.dedupe`: prompts (rows whose request repeats an earlier row's are written, not generated) and
outputs (samples whose text repeats an earlier sample's are listed and counted).

The driver finds them at planning (io/prompt_dupes.py: one pass over the input's request columns, the same
request fingerprint every output row carries) and stores the list under the output before any worker starts;
each worker marks the duplicates among a shard's requests (`DuplicateRows.mark`), and they become rows of
their own (driver/rows.py `error_row`: finish_reason `duplicate`, `dedupe_of` the first row's id, no error, no
tokens). Each input id still comes out exactly once, in the shard that holds it, so commits, retries and resume
are unchanged; the list depends only on the input, so every run and worker reads the same one. The manifest's
`dedupe` says how many rows, distinct prompts and duplicates the plan saw; the committed rows' finish reasons
(the run summary and the report) count the `duplicate` rows written.

Outputs (io/output_dupes.py): rows are generated as usual and carry `output_fingerprint`; when the last shard
commits, the driver lists the duplicate samples over every committed part and counts them in the manifest's
`dedupe` (recomputed by every run that finishes, so a resumed job counts all its rows).
"""

from __future__ import annotations

import threading
from typing import Any

from jobrunner.driver.row_images import image_prints
from jobrunner.driver.rows import RowRequest, fingerprint_roles, fingerprint_salt, id_column
from jobrunner.io.output_dupes import find_output_duplicates, write_output_duplicates
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
                                   fingerprint_roles(spec), fingerprint_salt(spec), image_prints(spec))
    write_duplicates(storage, found)
    manifest[DEDUPE_KEY] = {"mode": "prompts", **found.describe()}


def mark_duplicate_outputs(spec: JobSpec, storage: Storage, part_keys: list[str],
                           manifest: dict[str, Any]) -> None:
    """List the job's duplicate samples under the output and count them in the manifest (every shard
    committed: `part_keys` are their parts)."""
    if spec.output.dedupe != "outputs":
        return
    found = find_output_duplicates(storage, part_keys)
    write_output_duplicates(storage, found)
    manifest[DEDUPE_KEY] = found.describe()


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
