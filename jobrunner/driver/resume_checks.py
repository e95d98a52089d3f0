"""What a resume checks before it trusts an earlier run: the input files are the ones that run read (pinned
inputs), and each committed shard's parts are whole (size, and row count from the Parquet footer).

Pins: planning records each input file's size, ETag / version id / mtime and a digest (the sha1 of its
Parquet footer, or of a text file's bytes) in the manifest (`inputs`). A resume over a file whose size,
ETag or digest changed refuses, naming the file and what changed, as long as some shard is committed (its
rows came from the old file); a changed mtime alone (a file copied back in place) is fine when size and
digest are equal. A file missing now is named too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jobrunner.driver.manifest import ResumeError
from jobrunner.io.layout import PARTS_DIR
from jobrunner.io.parts import part_row_counts
from jobrunner.io.reader import InputFile
from jobrunner.io.shard_file import COMMITTED, COUNT_COLUMNS, ShardColumns
from jobrunner.io.storage import Storage
from jobrunner.redaction import redact_text, redacting_logger

log = redacting_logger(__name__)
INPUTS_KEY = "inputs"  # manifest key: one pin per input file, in plan order


def input_pins(files: list[InputFile]) -> list[dict[str, Any]]:
    """What identifies each input file's version, for the manifest."""
    return [{"file": redact_text(f.url), "bytes": f.num_bytes, "rows": f.num_rows, **f.stamps,
             "digest": f.digest} for f in files]


def check_pinned_inputs(old: dict[str, Any], old_shards: ShardColumns, files: list[InputFile]) -> None:
    """ResumeError naming each input file that changed (or went missing) since the run that wrote `old`,
    when that run committed rows (nothing committed: nothing to mix, so any input is fine)."""
    pins = old.get(INPUTS_KEY)
    if not pins or not (old_shards.status == COMMITTED).any():
        return
    now = {p["file"]: p for p in input_pins(files)}
    changes = [c for c in (_change(pin, now.get(pin["file"])) for pin in pins) if c]
    if changes:
        raise ResumeError("the input changed since the earlier run of this output, so its rows would be mixed "
                          f"with the rows already committed: {'; '.join(changes)}. Put the original file(s) "
                          "back, or start over with output.mode=overwrite (or another output.url)")


def _change(old: dict[str, Any], new: dict[str, Any] | None) -> str | None:
    """What changed in one file ('' when nothing that matters)."""
    name = old["file"]
    if new is None:
        return f"input file {name} is missing (it was read by the earlier run)"
    differ = [f"{label} {old[key]} -> {new.get(key)}" for key, label in
              (("bytes", "size"), ("rows", "rows"), ("etag", "ETag"))
              if old.get(key) is not None and new.get(key) is not None and old[key] != new[key]]
    if old.get("digest") and new.get("digest") and old["digest"] != new["digest"]:
        differ.append("content differs (Parquet footer / text digest)")
    if not differ:
        return None
    when = f", modified {old.get('mtime')} -> {new.get('mtime')}" if old.get("mtime") != new.get("mtime") else ""
    return f"input file {name} changed ({', '.join(differ)}{when})"


def trusted_parts(storage: Storage, old_shards: ShardColumns) -> set[str]:
    """The parts of committed shards that check out: every part present, with the size its commit record
    gives (when it gives one) and, together, the shard's row count in their Parquet footers. A shard with a
    missing, truncated or wrong part is left out (it runs again, and its parts are deleted as orphans)."""
    sizes = storage.list_sizes(PARTS_DIR)
    committed = np.flatnonzero(old_shards.status == COMMITTED).tolist()
    wanted = {p: sizes[p] for i in committed for p in old_shards.parts_of(i) if p in sizes}
    rows = part_row_counts(storage, wanted)
    rows_col, bytes_col = COUNT_COLUMNS.index("rows"), COUNT_COLUMNS.index("part_bytes")
    trusted: set[str] = set()
    for i in committed:  # no entry dict kept per shard: a resume of 10^6 shards stays columnar
        parts = old_shards.parts_of(i)
        entry = {"parts": parts, "rows": int(old_shards.counts[i, rows_col]),
                 "part_bytes": int(old_shards.counts[i, bytes_col])}
        problem = _part_problem(entry, sizes, rows)
        if problem:
            log.warning("shard %s runs again: %s", old_shards.id_of(i), problem)
        else:
            trusted.update(parts)
    return trusted


def _part_problem(entry: dict[str, Any], sizes: dict[str, int], rows: dict[str, int | None]) -> str | None:
    parts = entry["parts"]
    missing = [p for p in parts if p not in sizes]
    if not parts or missing:
        return f"part {', '.join(missing) or '(none recorded)'} is missing"
    recorded = entry["part_bytes"]  # summed over the parts in the shard table (0: not recorded)
    if recorded and sum(sizes[p] for p in parts) != recorded:
        return f"its parts hold {sum(sizes[p] for p in parts)} bytes, its record says {recorded}"
    unreadable = [p for p in parts if rows.get(p) is None]
    if unreadable:
        return f"part {', '.join(unreadable)} is not readable Parquet"
    total = sum(rows[p] or 0 for p in parts)
    if total != int(entry.get("rows") or 0):
        return f"its parts hold {total} rows, its record says {entry.get('rows')}"
    return None
