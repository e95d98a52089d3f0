"""Duplicate outputs of a job (`output.dedupe: outputs`): samples whose text another sample of the job already has.

Every output row of such a job carries `output_fingerprint`, a 64-bit hash of its `generated_text` (the id
hash of io/ids.py over the text's bytes; null where there is no text: an error row). When the last shard is
committed, the driver reads the id, sample index and fingerprint columns of every committed part (only those
column chunks) and lists each sample whose fingerprint an earlier sample has, earlier meaning a smaller
(id, sample_index), so the list is the same whatever order shards finished in; it is stored under the
output (`_plan/dedupe-outputs.parquet`: id, sample_index, dedupe_of, dedupe_of_sample) and counted in the
manifest. The rows themselves stay as committed (a part is never rewritten): the list marks them, for a
reader to drop with an anti-join on (id, sample_index).

Exact up to the 64-bit fingerprint: two different texts share one with a chance of about n^2 / 2^65.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobrunner.io.fingerprints import value_hashes
from jobrunner.io.storage import Storage, retry

OUTPUT_DUPLICATES_KEY = "_plan/dedupe-outputs.parquet"
OUTPUT_FINGERPRINT = "output_fingerprint"
_SCHEMA = pa.schema([("id", pa.string()), ("sample_index", pa.int64()), ("dedupe_of", pa.string()),
                     ("dedupe_of_sample", pa.int64())])


def output_fingerprints(texts: pa.Array | pa.ChunkedArray) -> pa.Array:
    """int64 [rows]: each text's fingerprint (as the signed integer the column holds); null where no text."""
    hashes = value_hashes(texts).view(np.int64)
    valid = texts.is_valid()
    return pa.array(hashes, pa.int64(), mask=pc.invert(valid).to_numpy(zero_copy_only=False))


@dataclass
class OutputDuplicates:
    """The job's duplicate samples: (id, sample_index) and the first sample with the same text."""

    table: pa.Table  # id, sample_index, dedupe_of, dedupe_of_sample
    num_samples: int  # samples with a text
    num_distinct: int  # distinct texts among them

    def describe(self) -> dict[str, int | str]:
        """The manifest's record."""
        return {"mode": "outputs", "samples": self.num_samples, "distinct_outputs": self.num_distinct,
                "duplicate_outputs": self.table.num_rows}


def find_output_duplicates(storage: Storage, part_keys: list[str]) -> OutputDuplicates:
    """Every sample of the committed parts whose text an earlier (smaller id, then sample index) sample has."""
    columns = ["id", "sample_index", OUTPUT_FINGERPRINT]
    tables = [retry(f"read {storage.display(k)}", lambda k=k: pq.read_table(storage.path(k), columns=columns,
                                                                           filesystem=storage.fs))
              for k in part_keys]
    table = pa.concat_tables(tables) if tables else pa.table({c: [] for c in columns})
    table = table.filter(pc.is_valid(table.column(OUTPUT_FINGERPRINT)))
    if not table.num_rows:
        return OutputDuplicates(_SCHEMA.empty_table(), 0, 0)
    table = table.sort_by([("id", "ascending"), ("sample_index", "ascending")])
    prints = table.column(OUTPUT_FINGERPRINT).to_numpy()
    _, first, inverse = np.unique(prints, return_index=True, return_inverse=True)
    first_of = first[inverse.reshape(-1)]  # np.unique's first index is the smallest (id, sample_index)
    dup = np.flatnonzero(first_of != np.arange(len(prints)))
    ids, samples = table.column("id").cast(pa.string()), table.column("sample_index")
    take, first_take = pa.array(dup, pa.int64()), pa.array(first_of[dup], pa.int64())
    out = pa.table({"id": ids.take(take), "sample_index": samples.take(take), "dedupe_of": ids.take(first_take),
                    "dedupe_of_sample": samples.take(first_take)}, schema=_SCHEMA)
    return OutputDuplicates(out, len(prints), len(first))


def write_output_duplicates(storage: Storage, duplicates: OutputDuplicates) -> None:
    """Store the list under the output."""
    sink = io.BytesIO()
    pq.write_table(duplicates.table, sink)
    storage.write_atomic(OUTPUT_DUPLICATES_KEY, sink.getvalue())
