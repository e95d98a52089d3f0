"""Duplicate ids across the whole input: found in bounded memory (spilled by bucket), confirmed as text."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.io import ids
from jobrunner.io.text_input import find_input_duplicates, list_input, row_location


def _dataset(tmp_path):
    pq.write_table(pa.table({"id": ["a", "b", "c", "d", "e"]}), tmp_path / "x.parquet", row_group_size=2)
    pq.write_table(pa.table({"id": pa.array([10, 2, None, 3], pa.int64())}), tmp_path / "y.parquet")
    (tmp_path / "z.jsonl").write_text('{"id": "q"}\n\n{"id": "d"}\n{"id": "2"}\n{"id": null}\n{"id": "a"}\n')
    return list_input(str(tmp_path), {}, "auto")


def _found(files, **kw):
    return [(d.row_id, d.first, d.again) for d in find_input_duplicates(files, {}, "auto", "id", **kw)]


EXPECTED = [("d", (0, 3), (2, 1)), ("2", (1, 1), (2, 2)), ("a", (0, 0), (2, 4))]


def test_duplicates_across_formats_earliest_repeat_first(tmp_path):
    files = _dataset(tmp_path)
    # an integer id 2 and a string id "2" are the same output id; null ids are not ids
    assert _found(files) == EXPECTED
    assert _found(files, limit=1) == EXPECTED[:1]
    assert row_location(files[2], 1, {}, "auto").endswith("z.jsonl line 3")
    assert row_location(files[0], 3, {}, "auto").endswith("x.parquet row 3")


def test_spilled_buckets_find_the_same(tmp_path, monkeypatch):
    files = _dataset(tmp_path)
    monkeypatch.setattr(ids, "BUCKET_RECORDS", 2)  # 14 ids -> 8 buckets on disk
    monkeypatch.setattr(ids, "SPILL_RECORDS", 3)
    monkeypatch.setattr(ids, "BATCH_ROWS", 2)
    made = []
    real_mkdtemp = ids.tempfile.mkdtemp
    monkeypatch.setattr(ids.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    assert _found(files) == EXPECTED
    assert len(made) == 1 and not os.path.exists(made[0])  # it spilled to disk, and cleaned up after itself


def test_hash_collisions_are_never_reported(tmp_path, monkeypatch):
    files = _dataset(tmp_path)
    monkeypatch.setattr(ids, "_mix", lambda z: np.zeros_like(z))  # every id hashes alike
    assert _found(files) == EXPECTED
    pq.write_table(pa.table({"id": [f"u{i}" for i in range(50)]}), tmp_path / "x.parquet")
    (tmp_path / "y.parquet").unlink()
    (tmp_path / "z.jsonl").unlink()
    assert _found(list_input(str(tmp_path), {}, "auto")) == []


def test_hash_is_a_function_of_the_text():
    hashes, positions = ids.hash_ids(pa.array(["", "a", None, "ab", "ba", "ab"]))
    assert positions.tolist() == [0, 1, 3, 4, 5]
    assert hashes[2] == hashes[4] and len(set(hashes.tolist())) == 4
    sliced, _ = ids.hash_ids(pa.array(["zz", "ab", "ba"]).slice(1))
    assert sliced.tolist() == hashes[2:4].tolist()
    assert ids.hash_ids(pa.array([7, None], pa.int64()))[0].tolist() == ids.hash_ids(pa.array(["7"]))[0].tolist()


@pytest.mark.parametrize("n", [1, 3])
def test_no_duplicates(tmp_path, n):
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(n)]}), tmp_path / "x.parquet")
    assert _found(list_input(str(tmp_path), {}, "auto")) == []
