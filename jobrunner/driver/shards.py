"""Shard planning: cut the input files into row ranges of about N rows, with stable ids.

A shard is (file, row_start, row_end). Boundaries follow row groups when they are small enough (so a shard
reads whole row groups), and split a big row group into even pieces; a worker fetches a split group once for
all the pieces it runs (io/row_groups.py), so no byte is fetched once per shard. The id hashes the file's position and
name and the range, so the same input and rows_per_shard always give the same shards, and a changed
plan is detected.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from jobrunner.io.reader import InputFile


@dataclass(frozen=True)
class Shard:
    """A row range of one input file: the unit of work, retry and output (one part per shard)."""

    shard_id: str
    file_url: str
    file_stem: str
    row_start: int
    row_end: int

    @property
    def num_rows(self) -> int:
        return self.row_end - self.row_start

    def to_dict(self) -> dict:
        return asdict(self)


def plan_shards(files: list[InputFile], rows_per_shard: int) -> list[Shard]:
    """Shards of every file, in file order."""
    shards: list[Shard] = []
    for file_index, f in enumerate(files):
        for start, end in _ranges(f.row_group_num_rows, rows_per_shard):
            shards.append(_make(len(shards), file_index, f, start, end))
    return shards


def _ranges(group_rows: tuple[int, ...], target: int) -> list[tuple[int, int]]:
    """Row ranges: consecutive row groups packed up to `target` rows; big groups split evenly."""
    ranges: list[tuple[int, int]] = []
    start = offset = 0
    for n in group_rows:
        if n > target:
            if offset > start:
                ranges.append((start, offset))
            ranges.extend(_split(offset, n, target))
            start = offset + n
        elif offset + n - start > target:
            ranges.append((start, offset))
            start = offset
        offset += n
    if offset > start:
        ranges.append((start, offset))
    return ranges


def _split(offset: int, n: int, target: int) -> list[tuple[int, int]]:
    pieces = -(-n // target)
    bounds = [offset + n * i // pieces for i in range(pieces + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def _make(index: int, file_index: int, f: InputFile, start: int, end: int) -> Shard:
    # The file's position and name (not its absolute URL) so a job moved to another machine keeps its ids.
    name = f.url.rsplit("/", 1)[-1]
    digest = hashlib.sha1(f"{file_index}|{name}|{start}|{end}".encode()).hexdigest()[:8]
    return Shard(shard_id=f"{index:05d}-{digest}", file_url=f.url, file_stem=f.stem, row_start=start,
                 row_end=end)
