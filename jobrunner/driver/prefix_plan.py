"""Prefix-aware shard planning: rows sharing a prompt prefix go to the same shards (`input.prefix_grouping`).

For each input file the planner streams the prompt column (or `input.prefix_column`) once, row group by row
group, and turns every row into a 64-bit prefix key (io/prefix_keys.py: hashes of the first L/64, L/16, L/4
and L characters of the prompt's text, L = `input.prefix_chars`). The text is a cheap approximation of the
rendered prompt: a raw prompt as is, chat messages as `role\\ncontent\\n` per message, no chat template (the
template adds the same header to every row, so the grouping is the same). It then sorts the file's rows by
key (spilling to local disk past a threshold: memory is bounded whatever the rows) and cuts the sorted rows
into shards of about `rows_per_shard` (between 1/2 and 3/2 of it), each cut where adjacent rows share the
shortest prefix, so a group is split across shards only when it is bigger than a shard. A file whose own
order already shares about as much as the sorted one (or whose rows share little) keeps its plain row-range
shards, exactly as without grouping.

A grouped file's shards are ranges of positions in its row order, which the planner writes under the output
(io/row_order.py), so a shard is still (file, start, end) in the shard table: resume, the commit protocol,
pieces of bisected shards and the duplicate-id check are unchanged, and so are the ids and content of every
output row. The shards of all files are ordered by their first key, so shards of one prefix are adjacent in
plan order, and the driver deals contiguous runs of the plan to workers (driver/prefix_dealing.py): a
prefix lives on as few workers as possible while idle workers steal from the longest run left.

An output first planned before this existed (its manifest has no `prefix_plan`) is resumed with plain
shards, as it was planned.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jobrunner.driver.shards import ShardTable, _ranges, _split, plan_shards
from jobrunner.io.prefix_keys import SPILL_RECORDS, KeySorter, level_chars, prefix_key, shared_chars, shared_depth
from jobrunner.io.reader import InputError, InputFile, file_pin
from jobrunner.io.row_order import RowOrderWriter
from jobrunner.io.shard_file import ShardColumns
from jobrunner.io.text_input import read_input_rows
from jobrunner.redaction import redact_text, redacting_logger
from jobrunner.spec import JobSpec

log = redacting_logger(__name__)

PLAN_KEY = "prefix_plan"  # manifest key: how the job was planned
MIN_SHARED_CHARS = 64  # average characters a row must share with its neighbour for grouping to be worth it
MIN_GAIN = 1.25  # the sorted order must share this much more than the file's own order
SCAN_ROWS = 1 << 14  # rows turned into keys at once (at least: a Parquet file is read a row group at a time)


@dataclass
class PrefixPlan:
    """How the planner grouped rows: recorded in the manifest, and what the driver deals by."""

    grouping: str  # auto | off (what was used: an old output resumes with off)
    prefix_chars: int
    prefix_column: str | None
    files_grouped: int = 0  # files whose shards are ranges of their sorted row order
    shares_prefixes: bool = False  # rows share prefixes: deal contiguous runs of shards to workers
    order_key: str | None = None  # the row order under the output
    order_local: str | None = None  # ... and its local copy until it is uploaded
    spilled_runs: int = 0  # sorted runs the key sort wrote to local disk (0: all in memory)
    _cleanup: Any = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        """The manifest's `prefix_plan` entry."""
        return {"grouping": self.grouping, "prefix_chars": self.prefix_chars, "prefix_column": self.prefix_column,
                "files_grouped": self.files_grouped, "shares_prefixes": self.shares_prefixes,
                "order": self.order_key}


@dataclass
class _FileShards:
    """One file's shards: (start, end, first key) each; positions of its row order when `grouped` (sorted by
    prefix when `by_prefix`, else the file's rows an incremental run takes, in row order)."""

    starts: list[int]
    ends: list[int]
    keys: list[int]
    grouped: bool
    order_digest: str = ""
    shares: bool = False
    by_prefix: bool = False


def check_prefix_column(spec: JobSpec, files: list[InputFile]) -> None:
    """InputError naming the file when `input.prefix_column` is set and a file lacks it."""
    column = spec.input.prefix_column
    for f in files if column else ():
        if column not in f.column_types:
            raise InputError(f"input file {f.url}: missing column {column!r} (input.prefix_column); "
                             f"columns are: {', '.join(f.column_types)}")


def effective_grouping(spec: JobSpec, old_manifest: dict[str, Any] | None) -> str:
    """The spec's `input.prefix_grouping`, except `off` for an output to resume that was planned before
    prefix grouping existed (its manifest, `old_manifest`, has no `prefix_plan`): its shards stay what they
    were."""
    if spec.input.prefix_grouping == "off" or spec.output.mode != "resume":
        return spec.input.prefix_grouping
    return "off" if old_manifest is not None and PLAN_KEY not in old_manifest else spec.input.prefix_grouping


def plan_prefix_shards(spec: JobSpec, files: list[InputFile], old_manifest: dict[str, Any] | None = None,
                       spill_records: int = SPILL_RECORDS, spill_dir: str | None = None,
                       selections: list[np.ndarray | None] | None = None) -> tuple[ShardTable, PrefixPlan]:
    """The shard table of the (non-empty) files, grouped by prefix where that pays, and how it was planned
    (old_manifest: see `effective_grouping`). `selections`: per file, the rows to plan (ascending row
    numbers; an incremental run's rows not done) or None for all of them; a file cut that way gets a row
    order of its own (its taken rows, sorted by prefix when grouping pays, else in row order)."""
    inp = spec.input
    plan = PrefixPlan(effective_grouping(spec, old_manifest), inp.prefix_chars, inp.prefix_column)
    selections = selections or [None] * len(files)
    if not files or (plan.grouping == "off" and all(rows is None for rows in selections)):
        return plan_shards(files, spec.rows_per_shard), plan
    tmp = tempfile.mkdtemp(prefix="jobrunner-plan-", dir=spill_dir)
    plan._cleanup = weakref.finalize(plan, _remove_dir, tmp)
    writer = RowOrderWriter(os.path.join(tmp, "rows.bin"))
    offsets: list[int | None] = []
    per_file: list[_FileShards] = []
    for f, rows in zip(files, selections, strict=True):
        start = writer.num_rows
        shards = _plan_one(spec, f, rows, writer, plan, spill_records, spill_dir)
        if not shards.grouped:
            writer.truncate(start)
        offsets.append(start if shards.grouped else None)
        per_file.append(shards)
        plan.shares_prefixes |= shards.shares
    plan.files_grouped = sum(s.by_prefix for s in per_file)
    key = writer.finish()
    if not any(s.grouped for s in per_file):
        return plan_shards(files, spec.rows_per_shard), plan
    plan.order_key, plan.order_local = key, writer.local_path
    table = _table(files, per_file)
    table.order_key, table.order_offsets = key, offsets
    return table, plan


def _plan_one(spec: JobSpec, f: InputFile, rows: np.ndarray | None, writer: RowOrderWriter, plan: PrefixPlan,
              spill_records: int, spill_dir: str | None) -> _FileShards:
    """One file's shards: by prefix when grouping is on and pays, else row ranges (or its taken rows)."""
    if plan.grouping == "off":
        return _row_order_shards(f, rows, writer, spec.rows_per_shard)
    try:
        return _plan_file(spec, f, writer, plan, spill_records, spill_dir, rows)
    except InputError as exc:  # an unreadable prompt page fails its own shard at run time, not the plan
        log.warning("prefix grouping skipped for %s (plain row ranges): %s", redact_text(f.url), exc)
        return _row_order_shards(f, rows, writer, spec.rows_per_shard)


def _row_order_shards(f: InputFile, rows: np.ndarray | None, writer: RowOrderWriter, target: int,
                      keys: list[int] | None = None) -> _FileShards:
    """Plain shards: row ranges of the file, or (`rows` given) ranges of positions in those rows, which become
    the file's row order."""
    if rows is None:
        natural = _ranges(f.row_group_num_rows, target)
        return _FileShards([s for s, _ in natural], [e for _, e in natural], keys or [0] * len(natural), False)
    writer.append(rows)
    ranges = _split(0, len(rows), target) if len(rows) else []
    digest = hashlib.sha1(np.ascontiguousarray(rows, "<i8").tobytes()).hexdigest()[:12]
    return _FileShards([s for s, _ in ranges], [e for _, e in ranges], keys or [0] * len(ranges), True,
                       "taken:" + digest)


def _remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _plan_file(spec: JobSpec, f: InputFile, writer: RowOrderWriter, plan: PrefixPlan, spill_records: int,
               spill_dir: str | None, rows: np.ndarray | None = None) -> _FileShards:
    """Scan one file's keys (only of `rows` when given), sort them and cut them; keep the plain ranges (or
    the taken rows in row order) when sorting gains too little."""
    chars = level_chars(spec.input.prefix_chars)
    target = spec.rows_per_shard
    start = writer.num_rows
    num_rows = f.num_rows if rows is None else len(rows)
    natural = _ranges(f.row_group_num_rows, target) if rows is None else _split(0, num_rows, target)
    natural_starts = np.array([s for s, _ in natural], np.int64)
    natural_keys = np.zeros(len(natural), np.uint64)
    sorter = KeySorter(spill_records, spill_dir)
    natural_score, previous, position = 0, None, 0
    for first, keys in _scan_keys(spec, f, chars, rows):
        numbers = np.arange(first, first + len(keys), dtype=np.int64)
        if rows is not None:
            wanted = _members(numbers, rows)
            keys, numbers = keys[wanted], numbers[wanted]
            if not len(keys):
                continue
        sorter.add(keys, numbers)
        natural_score += _score(previous, keys, chars)
        previous = keys[-1]
        here = (natural_starts >= position) & (natural_starts < position + len(keys))
        natural_keys[here] = keys[natural_starts[here] - position]
        position += len(keys)
    cutter, digest, sorted_score, previous = _Cutter(target), hashlib.sha1(), 0, None
    for block in sorter.sorted_blocks():
        if not len(block):
            continue
        writer.append(block["row"])
        digest.update(block["row"].tobytes())
        sorted_score += _score(previous, block["key"], chars)
        cutter.feed(_depths(previous, block["key"]), block["key"])
        previous = block["key"][-1]
    plan.spilled_runs += sorter.num_runs
    # an explicit input.prefix_column groups whenever rows share a value; a text prefix when it is long enough
    least = 1 if spec.input.prefix_column else MIN_SHARED_CHARS * max(num_rows, 1)
    enough = sorted_score >= least
    grouped = enough and sorted_score >= MIN_GAIN * natural_score
    shares = enough or natural_score >= least
    if not grouped:
        writer.truncate(start)
        plain = _row_order_shards(f, rows, writer, target, natural_keys.tolist())
        plain.shares = shares
        return plain
    starts, keys = cutter.finish()
    return _FileShards(starts, starts[1:] + [num_rows], keys, True, digest.hexdigest()[:12], shares=shares,
                       by_prefix=True)


def _members(numbers: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Which of `numbers` are in the sorted array `rows`."""
    at = np.minimum(np.searchsorted(rows, numbers), len(rows) - 1)
    return rows[at] == numbers if len(rows) else np.zeros(len(numbers), bool)


def _depths(previous: Any, keys: np.ndarray) -> np.ndarray:
    before = np.concatenate([[keys[0] if previous is None else previous], keys[:-1]]).astype(np.uint64)
    depth = shared_depth(before, keys)
    if previous is None:
        depth[0] = 0
    return depth


def _score(previous: Any, keys: np.ndarray, chars: tuple[int, ...]) -> int:
    return shared_chars(_depths(previous, keys), chars)


class _Cutter:
    """Cuts a stream of sorted rows into shards of about `target` rows, where adjacent rows share least."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.lo, self.hi = max(1, target // 2), max(1, target + target // 2)
        self.depth = np.zeros(0, np.uint8)
        self.keys = np.zeros(0, np.uint64)
        self.base = 0
        self.starts: list[int] = []
        self.first_keys: list[int] = []

    def feed(self, depth: np.ndarray, keys: np.ndarray) -> None:
        """The next rows: each one's shared depth with the row before it, and its key."""
        if not self.starts and len(keys):
            self.starts.append(0)
            self.first_keys.append(int(keys[0]))
        self.depth = np.concatenate([self.depth, depth])
        self.keys = np.concatenate([self.keys, keys])
        while len(self.depth) > self.hi:
            window = self.depth[self.lo:self.hi + 1]
            candidates = np.flatnonzero(window == window.min()) + self.lo
            cut = int(candidates[np.argmin(np.abs(candidates - self.target))])
            self.base += cut
            self.starts.append(self.base)
            self.first_keys.append(int(self.keys[cut]))
            self.depth, self.keys = self.depth[cut:], self.keys[cut:]

    def finish(self) -> tuple[list[int], list[int]]:
        """Shard starts (positions) and their first keys."""
        return self.starts, self.first_keys


def _scan_keys(spec: JobSpec, f: InputFile, chars: tuple[int, ...],
               rows: np.ndarray | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, keys of the next rows) over the file, a row group (or SCAN_ROWS rows) at a time; chunks
    holding none of `rows` (when given) are not read."""
    inp = spec.input
    column, kind = _key_column(spec)
    if kind == "value":  # an explicit key groups by its whole value: equal or not, at every depth
        chars = (1 << 62,) * len(chars)
    start = 0
    for end in _chunk_ends(f):
        if rows is not None and np.searchsorted(rows, start) == np.searchsorted(rows, end):
            start = end
            continue
        table = read_input_rows(f.url, inp.storage_options, inp.format, start, end, [column])
        values = table.column(column).to_pylist() if column in table.column_names else [None] * table.num_rows
        yield start, np.array([prefix_key(key_text(kind, v), chars) for v in values], np.uint64)
        start = end


def _chunk_ends(f: InputFile) -> list[int]:
    ends, offset, pending = [], 0, 0
    for n in f.row_group_num_rows:
        offset += n
        pending += n
        if pending >= SCAN_ROWS:
            ends.append(offset)
            pending = 0
    if pending or not ends:
        ends.append(f.num_rows)
    return [e for e in ends if e > 0]


def _key_column(spec: JobSpec) -> tuple[str, str]:
    """The input column keys are made of and how to read it (value | prompt | messages | openai)."""
    inp = spec.input
    if inp.prefix_column:
        return inp.prefix_column, "value"
    if inp.format == "openai_batch":
        return "body", "openai"
    if inp.prompt_column:
        return inp.prompt_column, "prompt"
    return inp.messages_column, "messages"


def key_text(kind: str, value: Any) -> str:
    """A row's text for its prefix key (a value that cannot be read is keyed by its text: it only groups)."""
    if value is None:
        return ""
    if kind == "openai":
        try:
            body = json.loads(value) if isinstance(value, str) else value
            value = body.get("messages") or body.get("prompt") or ""
            kind = "messages" if isinstance(value, list) else "prompt"
        except (ValueError, AttributeError):
            return str(value)
    if kind == "messages":
        return messages_text(value)
    return value if isinstance(value, str) else str(value)


def messages_text(value: Any) -> str:
    """Chat messages as `role\\ncontent\\n` per message (the template's constant decoration left out)."""
    try:
        messages = json.loads(value) if isinstance(value, str) else value
        return "".join(f"{m.get('role')}\n{m.get('content')}\n" for m in messages)
    except (ValueError, TypeError, AttributeError):
        return str(value)


def _table(files: list[InputFile], per_file: list[_FileShards]) -> ShardTable:
    """Every file's shards ordered by first key (then file, start), with ids naming the order."""
    rows = [(key, file_index, start, end) for file_index, s in enumerate(per_file)
            for start, end, key in zip(s.starts, s.ends, s.keys, strict=True)]
    rows.sort()
    ids = [_shard_id(i, files[fi], fi, start, end, per_file[fi].order_digest)
           for i, (_, fi, start, end) in enumerate(rows)]
    columns = ShardColumns.pending(np.array(ids, dtype=bytes), np.array([r[1] for r in rows], np.int32),
                                   [f.url for f in files], np.array([r[2] for r in rows], np.int64),
                                   np.array([r[3] for r in rows], np.int64))
    return ShardTable(columns, [f.stem for f in files], [file_pin(f) for f in files])


def _shard_id(index: int, f: InputFile, file_index: int, start: int, end: int, order_digest: str) -> bytes:
    """"<index>-<8 hex digits>", the digest naming the file, the range and (grouped files) the row order, so
    a grouped shard never takes the id of a plain one."""
    name = f.url.rsplit("/", 1)[-1]
    order = f"|order:{order_digest}" if order_digest else "|prefix-plan"
    digest = hashlib.sha1(f"{file_index}|{name}|{start}|{end}{order}".encode()).hexdigest()[:8]
    return f"{index:05d}-{digest}".encode()
