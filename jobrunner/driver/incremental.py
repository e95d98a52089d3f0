"""Incremental runs (`output.mode: incremental`): an output that grows with its input, each id once.

A nightly input grows: rows appended to its files, new files in its folder. A resume refuses a changed input
(its shards were cut from the old files), and an overwrite recomputes every row. An incremental run instead
plans by ids, under the output's lease:

1. The output's committed shards whose parts check out (driver/resume_checks.py: `trusted_parts`) are kept
   as they are; shards that were pending, failed or lost are dropped (their rows are not done, so they are
   planned again) and parts no kept shard names are deleted, as a resume does.
2. The done ids are read from those parts and from the committed parts of the outputs that
   `output.skip_done_from` names (last night's dated folder, or a glob of them): one id column each, into a
   columnar index (io/done_ids.py: sorted 64-bit hashes, ids confirmed as text).
3. Each input file is read once (its ids, and its request columns unless `output.check_done_prompts` is
   false, io/done_rows.py): a row whose id is done is skipped; a done id whose request fingerprint differs
   from its output row's is skipped too, but counted and listed as changed (exactly once by id: a changed
   prompt is never rerun silently, nor dropped silently).
4. The rows taken are cut into new shards (driver/prefix_plan.py: a file read whole keeps its row ranges; a
   file with skipped rows gets a row order of its taken rows under `_plan/`), with ids no earlier run of
   the output used (the lease generation is in their digest), after the kept shards in one shard table.

The run then goes as any other: commits, crashes, leases and retries are unchanged, and a crash followed by
another incremental run plans again from what was committed (exactly once). The manifest's `incremental`
holds the latest run's plan (done ids per source, each input file's rows taken / skipped / changed and the
row ranges taken); each `runs` entry keeps its own.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobrunner.driver.manifest import ResumeError
from jobrunner.driver.prefix_plan import PrefixPlan, plan_prefix_shards
from jobrunner.driver.resume_check import MAX_SHOWN, name_difference, num_committed, spec_differences
from jobrunner.driver.row_images import image_prints
from jobrunner.driver.rows import fingerprint_roles, fingerprint_salt, id_column
from jobrunner.driver.shards import ShardTable
from jobrunner.io.done_ids import DoneIdsBuilder, DoneIdsError, list_outputs
from jobrunner.io.done_rows import MAX_LISTED_CHANGED, FileScan, RequestColumns, scan_file
from jobrunner.io.manifest import read_manifest_table
from jobrunner.io.reader import InputFile, map_files
from jobrunner.io.shard_file import COMMITTED, ShardColumns
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec

INCREMENTAL_KEY = "incremental"  # manifest: the latest incremental run's plan (each `runs` entry: its own)
MAX_LISTED_FILES = 1000  # input files listed per run (those that gave rows or had a changed request)
MAX_RANGES = 8  # row ranges listed per file (the exact rows are the file's row order under _plan/)
# fields an incremental run may change against the runs before it: the input grows (a dated folder, a limit)
FREE_FIELDS = ("input.url", "input.limit")
# said when done ids whose request changed are derived ids: most likely new rows that repeat an old file's name
DERIVED_HINT = ("; these ids are derived ('<file-stem>:<row>'), so a new file named like an earlier one repeats "
                "its ids: set input.id_column, or give each night's file its own name")


@dataclass
class IncrementalPlan:
    """What one incremental run takes and skips (the manifest's `incremental`)."""

    sources: list[dict[str, Any]]  # {"output": url, "done_ids": n}: this output first
    num_done_ids: int
    files: list[dict[str, Any]]  # input files that gave rows or had a changed request
    rows_input: int = 0
    rows_taken: int = 0
    rows_skipped: int = 0
    num_changed: int = 0
    changed: list[dict[str, Any]] = field(default_factory=list)  # the first MAX_LISTED_CHANGED: id, file, row
    num_unchecked: int = 0  # done ids whose output row has no fingerprint (written before fingerprints)
    files_all_done: int = 0
    index_bytes: int = 0
    seconds: float = 0.0
    derived_ids: bool = False  # no id column: rows are known as '<file-stem>:<row>'

    def describe(self) -> dict[str, Any]:
        """The manifest entry."""
        return {"rows_input": self.rows_input, "rows_taken": self.rows_taken, "rows_skipped": self.rows_skipped,
                "done_ids": self.num_done_ids, "sources": self.sources, "changed_requests": self.num_changed,
                "changed": self.changed, "unchecked": self.num_unchecked, "files": self.files,
                "files_all_done": self.files_all_done, "index_bytes": self.index_bytes,
                "plan_s": round(self.seconds, 3), **({"derived_ids": True} if self.derived_ids else {})}

    def line(self) -> str:
        """One line for the operator."""
        done_in = ", ".join(f"{s['done_ids']} in {s['output']}" for s in self.sources if s["done_ids"])
        text = (f"incremental: taking {self.rows_taken} of {self.rows_input} input rows; {self.rows_skipped} "
                f"skipped as done ({self.num_done_ids} done ids: {done_in or 'none yet'})")
        if self.num_changed:
            shown = ", ".join(repr(c["id"]) for c in self.changed[:5])
            text += (f"; {self.num_changed} done id(s) whose request changed since their output was written "
                     f"(skipped, not rerun: each id is done once; e.g. {shown})")
            text += DERIVED_HINT if self.derived_ids else ""
        if self.num_unchecked:
            text += f"; {self.num_unchecked} done id(s) not checked for a changed request (output without fingerprints)"
        return text


def check_settings(header: dict[str, Any], old_shards: ShardColumns, spec: JobSpec) -> None:
    """ResumeError when the committed rows were made with another model, other sampling or prompt settings or
    by another job: an incremental run adds rows to an output made with the same ones."""
    lines = [f"{name}: {before!r} -> {now!r}" for name, before, now in
             spec_differences(header.get("spec") or {}, spec.redacted()) if name not in FREE_FIELDS]
    lines = name_difference(header, spec) + lines
    if not lines:
        return
    shown = lines[:MAX_SHOWN] + ([f"... and {len(lines) - MAX_SHOWN} more"] if len(lines) > MAX_SHOWN else [])
    raise ResumeError(
        f"output.url {spec.output.url!r} holds {num_committed(old_shards)} committed shard(s) written with other "
        "settings:\n  " + "\n  ".join(shown) + "\nAn incremental run adds rows made with the same settings: keep "
        "the old values, or write this run to a new output.url (naming this one in output.skip_done_from to "
        "skip its ids), or start over with output.mode=overwrite.")


def kept_shards(old_shards: ShardColumns, trusted: set[str]) -> ShardColumns:
    """The committed shards whose parts all check out (the rest runs again as new shards)."""
    committed = np.flatnonzero(old_shards.status == COMMITTED)
    keep = [i for i in committed.tolist() if all(p in trusted for p in old_shards.parts_of(i))]
    return old_shards.take(np.array(keep, np.int64))


def plan_incremental(spec: JobSpec, files: list[InputFile], storage: Storage, kept: ShardColumns | None,
                     generation: int) -> tuple[ShardTable, PrefixPlan, IncrementalPlan]:
    """The shard table of this run (`kept`, then new shards of the rows of `files` not done), how its rows
    were grouped, and what it takes; DoneIdsError when an earlier output or a committed part cannot be
    read."""
    started = time.monotonic()
    builder = DoneIdsBuilder()
    own_parts = _committed_parts(kept) if kept is not None else []
    sources = [{"output": redact_text(storage.display()), "done_ids": builder.add_parts(storage, own_parts, 0)}]
    for code, (url, other, parts) in enumerate(earlier_outputs(spec, storage), start=1):
        sources.append({"output": redact_text(url), "done_ids": builder.add_parts(other, parts, code)})
    done = builder.finish()
    files = [f for f in files if f.num_rows]
    checked = spec.output.check_done_prompts
    request = RequestColumns(fingerprint_roles(spec) if checked else {}, fingerprint_salt(spec),
                             image_prints(spec) if checked else None)
    inp = spec.input
    scans = map_files(lambda f: scan_file(f, inp.storage_options, inp.format, id_column(spec), done, request),
                      files, threads=8)
    taking = [(f, s) for f, s in zip(files, scans, strict=True) if s.num_taken]
    table, prefix = plan_prefix_shards(spec, [f for f, _ in taking], None, selections=[s.taken for _, s in taking])
    first = len(kept) if kept is not None else 0
    table.columns.shard_id = _new_ids(table.columns.shard_id, first, generation)
    result = _describe(files, scans, sources, len(done), done.nbytes, table)
    result.seconds, result.derived_ids = time.monotonic() - started, id_column(spec) is None
    return _merged(kept, table), prefix, result


def earlier_outputs(spec: JobSpec, own: Storage) -> list[tuple[str, Storage, list[str]]]:
    """(URL, storage, committed part keys) of each output `output.skip_done_from` names (this output left
    out); DoneIdsError naming an entry that is not a jobrunner output."""
    opts = spec.output.storage_options
    found: list[tuple[str, Storage, list[str]]] = []
    for entry in spec.output.skip_done_from:
        for url in list_outputs(entry, opts):
            other = Storage(url, opts)
            if other.location() == own.location() or any(o.location() == other.location() for _, o, _ in found):
                continue
            table = read_manifest_table(other)
            if table is None:
                raise DoneIdsError(f"output.skip_done_from: {redact_text(url)} has no _manifest.json: not a jobrunner "
                                   "output (name an output folder, or a glob of them such as s3://bucket/nightly/*)")
            found.append((url, other, _committed_parts(table[1])))
    return found


def _committed_parts(columns: ShardColumns) -> list[str]:
    return [p for i in np.flatnonzero(columns.status == COMMITTED).tolist() for p in columns.parts_of(i)]


def _new_ids(ids: np.ndarray, first: int, generation: int) -> np.ndarray:
    """The new shards' ids: numbered after the kept ones, their digest salted with the lease generation, so no
    id (and no part name) of an earlier run of this output comes back."""
    out = [f"{first + i:05d}-{hashlib.sha1(b'%s|gen%d' % (old, generation)).hexdigest()[:8]}".encode()
           for i, old in enumerate(ids.tolist())]
    return np.array(out, dtype=bytes) if out else ids


def _merged(kept: ShardColumns | None, new: ShardTable) -> ShardTable:
    """One table: the kept shards (committed, never handed out again), then this run's."""
    if kept is None or not len(kept):
        return new
    columns, file_map = kept.concat(new.columns)
    count = len(columns.file.values)
    stems, pins, offsets = [""] * count, [None] * count, [None] * count
    for code, merged in enumerate(file_map):
        stems[merged] = new.file_stems[code]
        pins[merged] = new.file_pins[code] if new.file_pins else None
        offsets[merged] = new.order_offsets[code] if code < len(new.order_offsets) else None
    table = ShardTable(columns, stems, pins)
    table.order_key, table.order_offsets = new.order_key, offsets
    return table


def _describe(files: list[InputFile], scans: list[FileScan], sources: list[dict[str, Any]], num_done: int,
              index_bytes: int, table: ShardTable) -> IncrementalPlan:
    result = IncrementalPlan(sources=sources, num_done_ids=num_done, files=[], index_bytes=index_bytes)
    for f, scan in zip(files, scans, strict=True):
        result.rows_input += scan.num_rows
        result.rows_taken += scan.num_taken
        result.rows_skipped += scan.num_skipped
        result.num_changed += scan.num_changed
        result.num_unchecked += scan.num_unchecked
        for row, row_id in scan.changed[:max(0, MAX_LISTED_CHANGED - len(result.changed))]:
            result.changed.append({"id": row_id, "file": redact_text(f.url), "row": row})
        if not scan.num_taken and not scan.num_changed:
            result.files_all_done += 1
        elif len(result.files) < MAX_LISTED_FILES:
            result.files.append(_file_entry(f, scan, table))
    return result


def _file_entry(f: InputFile, scan: FileScan, table: ShardTable) -> dict[str, Any]:
    entry: dict[str, Any] = {"file": redact_text(f.url), "rows": scan.num_rows, "taken": scan.num_taken,
                             "skipped": scan.num_skipped, "changed": scan.num_changed}
    taken = np.arange(scan.num_rows, dtype=np.int64) if scan.taken is None else scan.taken
    entry["taken_rows"], more = _ranges(taken)
    if more:
        entry["more_ranges"] = more
    values = table.columns.file.values
    code = values.index(f.url) if f.url in values else None
    offset = table.order_offsets[code] if code is not None and code < len(table.order_offsets) else None
    if offset is not None:  # the exact rows taken: int64 row numbers from this position (io/row_order.py)
        entry["row_order"] = {"key": table.order_key, "offset": offset, "rows": scan.num_taken}
    return entry


def _ranges(rows: np.ndarray) -> tuple[list[list[int]], int]:
    """[[start, end), ...] of consecutive rows, the first MAX_RANGES, and how many more there are."""
    if not len(rows):
        return [], 0
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(rows)]])
    spans = [[int(rows[s]), int(rows[e - 1]) + 1] for s, e in zip(starts[:MAX_RANGES], ends[:MAX_RANGES], strict=True)]
    return spans, max(0, len(starts) - MAX_RANGES)
