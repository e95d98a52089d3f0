"""The ids that already have a committed output row, as columns: what an incremental run skips.

`DoneIds` holds, for every done id, its 64-bit hash (io/ids.py: `hash_ids`, the hash the duplicate check
uses), the id itself, the request fingerprint its output row carries (io/fingerprints.py; 0 when the part
was written before fingerprints existed) and which output it came from, all as arrays sorted by hash: 8 +
8 + 2 bytes plus the id's own bytes per id, no Python object per id (a set of 10^7 short strings would cost
about 1 GB). A lookup hashes a batch of input ids, finds equal hashes by binary search, and then compares
the candidates' ids as text (Arrow, vectorised), so a hash collision can never skip a row that is not done.

The ids are read from committed parts only (the shard table names them; a part left by a crash before its
commit record is no output), one column chunk each (`id`, `sample_index`, `request_fingerprint`: never the
generated text), many parts at once. A row sampled n times is one id: only `sample_index` 0 is taken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from jobrunner.io.ids import hash_ids
from jobrunner.io.layout import MANIFEST
from jobrunner.io.reader import _open_exact, map_files
from jobrunner.io.storage import Storage, StorageError, retry

FINGERPRINT_COLUMN = "request_fingerprint"
PART_ID_COLUMNS = ("id", "sample_index", FINGERPRINT_COLUMN)


class DoneIdsError(ValueError):
    """A committed part whose ids cannot be read (the message names it)."""


@dataclass
class DoneIds:
    """Done ids sorted by hash (see the module docstring); build with `DoneIdsBuilder`."""

    hashes: np.ndarray  # uint64 [n], sorted
    ids: pa.Array  # large_string [n], in the same order
    fingerprints: np.ndarray  # uint64 [n]; 0 = the part has no fingerprint (written before they existed)
    sources: np.ndarray  # int16 [n]: which output (the builder's source codes)

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        """Bytes the index holds."""
        return self.hashes.nbytes + self.fingerprints.nbytes + self.sources.nbytes + self.ids.nbytes

    def lookup(self, ids: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """(positions in `ids` of the ids that are done, the entry of each in this index); nulls never are."""
        hashes, positions = hash_ids(ids)
        if not len(self) or not len(hashes):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        order = np.argsort(hashes)  # sorted queries walk the index in order: ~3x faster than random probes
        at = np.empty(len(hashes), np.int64)
        at[order] = np.searchsorted(self.hashes, hashes[order])
        inside = np.minimum(at, len(self) - 1)
        hit = (at < len(self)) & (self.hashes[inside] == hashes)
        positions, at = positions[hit], at[hit]
        if not len(positions):
            return positions, at
        if isinstance(ids, pa.ChunkedArray):
            ids = ids.combine_chunks()
        mine = pc.cast(ids.take(pa.array(positions)), pa.large_string())
        same = np.asarray(pc.equal(mine, self.ids.take(pa.array(at))).to_numpy(zero_copy_only=False), bool)
        for k in np.flatnonzero(~same):  # a hash shared by two ids: look along the run of equal hashes
            found = self._along(int(at[k]), mine[int(k)].as_py())
            if found is not None:
                at[k], same[k] = found, True
        return positions[same], at[same]

    def _along(self, start: int, text: str) -> int | None:
        end = start + 1
        while end < len(self) and self.hashes[end] == self.hashes[start]:
            if self.ids[end].as_py() == text:
                return end
            end += 1
        return None


@dataclass
class DoneIdsBuilder:
    """Collects (ids, fingerprints) chunks from parts, then sorts them once into a `DoneIds`."""

    hashes: list[np.ndarray] = field(default_factory=list)
    ids: list[pa.Array] = field(default_factory=list)
    fingerprints: list[np.ndarray] = field(default_factory=list)
    sources: list[np.ndarray] = field(default_factory=list)

    def add(self, ids: pa.Array, fingerprints: np.ndarray | None, source: int) -> None:
        """Done ids (nulls dropped) with their fingerprints (None: unknown), from output `source`."""
        hashes, positions = hash_ids(ids)
        if len(positions) < len(ids):
            ids = ids.take(pa.array(positions))
            fingerprints = None if fingerprints is None else fingerprints[positions]
        self.hashes.append(hashes)
        self.ids.append(pc.cast(ids, pa.large_string()))
        self.fingerprints.append(np.zeros(len(hashes), np.uint64) if fingerprints is None
                                 else np.asarray(fingerprints, np.uint64))
        self.sources.append(np.full(len(hashes), source, np.int16))

    def add_parts(self, storage: Storage, part_keys: list[str], source: int) -> int:
        """The ids of these committed parts of one output (read concurrently); how many were added."""
        before = sum(len(h) for h in self.hashes)
        for ids, fingerprints in map_files(lambda key: read_part_ids(storage, key), part_keys):
            self.add(ids, fingerprints, source)
        return sum(len(h) for h in self.hashes) - before

    def finish(self) -> DoneIds:
        """The index, sorted by hash (the chunks are released)."""
        if not self.hashes:
            return DoneIds(np.zeros(0, np.uint64), pa.array([], pa.large_string()), np.zeros(0, np.uint64),
                           np.zeros(0, np.int16))
        hashes = np.concatenate(self.hashes)
        order = np.argsort(hashes, kind="stable")
        ids = pa.chunked_array(self.ids, pa.large_string()).combine_chunks()
        fingerprints, sources = np.concatenate(self.fingerprints), np.concatenate(self.sources)
        self.hashes, self.ids, self.fingerprints, self.sources = [], [], [], []  # the chunks go before the take
        return DoneIds(hashes[order], ids.take(pa.array(order)), fingerprints[order], sources[order])


def read_part_ids(storage: Storage, key: str) -> tuple[pa.Array, np.ndarray | None]:
    """(ids, fingerprints or None) of one committed part, sample 0 of each id; only those column chunks are
    fetched. DoneIdsError names the part when it cannot be read."""
    path = storage.path(key)

    def load() -> pa.Table:
        with _open_exact(storage.fs, path) as f:
            parquet = pq.ParquetFile(f, pre_buffer=False)
            columns = [c for c in PART_ID_COLUMNS if c in parquet.schema_arrow.names]
            return parquet.read(columns=columns)

    try:
        table = retry(f"read {storage.display(key)}", load)
    except (OSError, pa.ArrowInvalid, StorageError) as exc:
        raise DoneIdsError(f"committed part {storage.display(key)}: cannot read its ids ({exc})") from None
    if "id" not in table.column_names:
        raise DoneIdsError(f"committed part {storage.display(key)} has no 'id' column: not a jobrunner part")
    if "sample_index" in table.column_names:
        table = table.filter(pc.fill_null(pc.equal(table.column("sample_index"), 0), True))
    ids = table.column("id").combine_chunks()
    if FINGERPRINT_COLUMN not in table.column_names:
        return ids, None
    stored = table.column(FINGERPRINT_COLUMN).combine_chunks()
    values = np.asarray(pc.fill_null(stored, 0).to_numpy(zero_copy_only=False), np.int64)
    return ids, values.view(np.uint64)


def list_outputs(url: str, storage_options: dict) -> list[str]:
    """The output URLs an `output.skip_done_from` entry names: the URL itself, or (a glob) every folder it
    matches that holds a `_manifest.json`, sorted."""
    fs, path = url_to_fs(url, **storage_options)
    if not any(c in path for c in "*?["):
        return [url]
    fs.invalidate_cache()
    found = retry(f"glob {url}", lambda: fs.glob(f"{path.rstrip('/')}/{MANIFEST}"))
    return sorted(fs.unstrip_protocol(p.rsplit("/", 1)[0]) for p in found)
