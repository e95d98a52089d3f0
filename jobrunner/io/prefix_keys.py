"""Prefix keys of input rows and their sort, in memory bounded whatever the rows (prefix-aware planning).

A row's key packs four 16-bit hashes of its text's first L/64, L/16, L/4 and L characters
(L = `input.prefix_chars`; a shorter text: all of it) into one uint64, the shortest prefix in the top
bits. Sorting rows by key is then a trie order at four depths: rows whose first L/4 characters agree are
contiguous, and within them the rows whose first L agree. Two adjacent keys share `depth` leading fields
(0-4): the planner cuts shards where the depth is lowest. Each depth hashes with its own salt, so a 16-bit
collision stays one depth deep: it only orders two unrelated prefixes side by side, and never changes a
row (grouping decides where a row runs, not what it computes).

(key, row) records stay in memory up to `spill_records` in all; above that each full buffer is sorted and
written to local disk as a run, and the runs are merged block by block (memory-mapped), so memory holds one
buffer plus one block per run, at 10^8 rows as at 10^3.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import numpy as np

RECORD = np.dtype([("key", "<u8"), ("row", "<i8")])
LEVELS = 4
LEVEL_BITS = 16
SPILL_RECORDS = 1 << 21  # records held before a sorted run goes to disk (32 MiB)
MERGE_BLOCK = 1 << 16  # records read from each run at a time while merging


def level_chars(prefix_chars: int) -> tuple[int, ...]:
    """The prefix lengths hashed into a key: L/64, L/16, L/4, L characters."""
    return tuple(max(1, prefix_chars >> (2 * (LEVELS - 1 - k))) for k in range(LEVELS))


def prefix_key(text: str, chars: tuple[int, ...]) -> int:
    """The packed key of one text (the shortest prefix's hash in the top 16 bits). Each depth hashes with
    its own salt, so two different texts whose 16-bit hashes collide at one depth (1 in 65,536) do not
    also agree at the next: a collision looks like a short shared prefix, never a long one."""
    key = 0
    data = text.encode("utf-8", "surrogatepass")
    for depth, n in enumerate(chars):
        piece = data if n >= len(text) else text[:n].encode("utf-8", "surrogatepass")
        digest = hashlib.blake2b(piece, digest_size=2, person=b"jr-prefix-%d" % depth).digest()
        key = (key << LEVEL_BITS) | int.from_bytes(digest, "big")
    return key


def shared_depth(previous: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Leading key fields (0-4) each key shares with the one before it: uint8, same length as `keys`."""
    diff = previous.astype(np.uint64) ^ keys.astype(np.uint64)
    depth = np.zeros(len(keys), np.uint8)
    same = np.ones(len(keys), bool)
    for k in range(LEVELS):
        shift = np.uint64(LEVEL_BITS * (LEVELS - 1 - k))
        same &= ((diff >> shift) & np.uint64(0xFFFF)) == 0
        depth += same
    return depth


def shared_chars(depth: np.ndarray, chars: tuple[int, ...]) -> int:
    """Characters the rows share with their predecessors, as the depths say (a sharing score of an order)."""
    table = np.array((0, *chars), np.int64)
    return int(table[depth].sum())


class KeySorter:
    """Collects (key, row) records and gives them back sorted by key, then row; spills past a threshold."""

    def __init__(self, spill_records: int = SPILL_RECORDS, spill_dir: str | None = None) -> None:
        self.spill_records = spill_records
        self.spill_dir = spill_dir
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._runs: list[str] = []
        self._tmp: str | None = None
        self.num_runs = 0  # sorted runs written to disk so far (0: everything in memory)

    def add(self, keys: np.ndarray, rows: np.ndarray) -> None:
        """Add records; rows must come in increasing order across calls (ties then keep row order)."""
        records = np.empty(len(keys), RECORD)
        records["key"], records["row"] = keys, rows
        self._buffer.append(records)
        self._buffered += len(records)
        if self._buffered >= self.spill_records:
            self._spill()

    def sorted_blocks(self) -> Iterator[np.ndarray]:
        """Every record, sorted, in blocks (the sorter is empty afterwards)."""
        try:
            if not self._runs:
                merged = _sorted(self._take())
                for start in range(0, len(merged), MERGE_BLOCK):
                    yield merged[start:start + MERGE_BLOCK]
                return
            if self._buffered:
                self._spill()
            yield from _merge([np.load(path, mmap_mode="r") for path in self._runs])
        finally:
            self.close()

    def close(self) -> None:
        """Remove the spilled runs."""
        self._buffer, self._buffered, self._runs = [], 0, []
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _take(self) -> np.ndarray:
        records = np.concatenate(self._buffer) if self._buffer else np.empty(0, RECORD)
        self._buffer, self._buffered = [], 0
        return records

    def _spill(self) -> None:
        if self._tmp is None:
            self._tmp = tempfile.mkdtemp(prefix="jobrunner-prefix-", dir=self.spill_dir)
        path = os.path.join(self._tmp, f"run-{len(self._runs)}.npy")
        np.save(path, _sorted(self._take()))
        self._runs.append(path)
        self.num_runs += 1


def _sorted(records: np.ndarray) -> np.ndarray:
    return records[np.lexsort((records["row"], records["key"]))]


def _merge(runs: list[np.ndarray]) -> Iterator[np.ndarray]:
    """K-way merge of sorted runs, a block from each at a time: every record not above the smallest last
    record of the blocks still to be refilled is final and goes out sorted."""
    cursors = [0] * len(runs)
    pending = np.empty(0, RECORD)
    while True:
        blocks, limits = [pending], []
        for i, run in enumerate(runs):
            block = np.asarray(run[cursors[i]:cursors[i] + MERGE_BLOCK])
            cursors[i] += len(block)
            blocks.append(block)
            if cursors[i] < len(run) and len(block):
                limits.append((int(block["key"][-1]), int(block["row"][-1])))
        merged = _sorted(np.concatenate(blocks))
        if not limits:
            if len(merged):
                yield merged
            return
        key, row = min(limits)
        final = (merged["key"] < np.uint64(key)) | ((merged["key"] == np.uint64(key)) & (merged["row"] <= row))
        yield merged[final]
        pending = merged[~final]
