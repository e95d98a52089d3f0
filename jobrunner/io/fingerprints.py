"""Request fingerprints: one 64-bit hash per input row of what its request is made of, computed on columns.

An incremental run (docs/driver.md, "Incremental runs") skips the rows whose ids already have a committed
output row, and reports a done id whose request changed since (not rerun, not silently skipped). For that
every output row carries `request_fingerprint`, and planning computes the same value for the input rows:
a hash of the row's request columns (prompt or messages, system prompt, per-row sampling, template
variables, tools; the OpenAI request line) combined with a salt of the job's prompt settings.

Values are hashed as columns, never as Python objects: strings and binaries over their bytes (the id hash
of io/ids.py), numbers and booleans over their text (`7` and `7.0` read the same), a struct as the sum of
its non-null fields mixed with each field's name (so a field that a later file adds, null in the older
rows, changes nothing), a list as the sum of its elements mixed with their positions, a map as a list of
(key, value) structs. A null value hashes to 0.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobrunner.io.ids import _hash_strings, _mix

_LIST_TAG = np.uint64(0xA24BAED4963EE407)
_STRUCT_TAG = np.uint64(0x9FB21C651E98DF25)
_POSITION = np.uint64(0xC13FA9A902A6328F)
IMAGE_CONTENT_ROLE = "image_content"  # the content of images named by URL or path (io/image_prints.py)


def text_salt(text: str) -> np.uint64:
    """A 64-bit salt from a text (a column role, a field name, the job's prompt settings)."""
    return np.uint64(int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "little"))


def request_fingerprints(table: pa.Table, role_columns: dict[str, str], salt: np.uint64,
                         images: Callable[[pa.Table], np.ndarray] | None = None) -> np.ndarray:
    """uint64 [rows]: each row's fingerprint over the columns `role_columns` names (role -> column; a column
    missing from `table` counts as null), mixed with `salt`. Roles, not column names, are mixed in, so a
    renamed column keeps its rows' fingerprints. `images`: each row's hash of the content of the images it
    names by reference (io/image_prints.py; 0: none), mixed in as one more role."""
    total = np.zeros(table.num_rows, np.uint64)
    for role, column in sorted(role_columns.items()):
        if column not in table.column_names:
            continue
        total += _role_term(value_hashes(table.column(column)), role)
    if images is not None and table.num_rows:
        total += _role_term(images(table), IMAGE_CONTENT_ROLE)
    return _mix(total ^ salt)


def _role_term(values: np.ndarray, role: str) -> np.ndarray:
    return np.where(values != 0, _mix(values + text_salt(role)), np.uint64(0))


def value_hashes(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """uint64 [len]: a hash of each value (0 for null), as the module docstring describes."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    if len(values) == 0:
        return np.zeros(0, np.uint64)
    kind = values.type
    if pa.types.is_dictionary(kind):
        return value_hashes(values.dictionary_decode())
    if pa.types.is_null(kind):
        return np.zeros(len(values), np.uint64)
    if pa.types.is_struct(kind):
        out = _struct_hashes(values)
    elif pa.types.is_map(kind):
        out = _list_hashes(_map_as_list(values))
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        out = _list_hashes(values)
    else:
        out = _scalar_hashes(values)
    return np.where(_valid(values), out, np.uint64(0))


def _valid(values: pa.Array) -> np.ndarray:
    return np.asarray(values.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _scalar_hashes(values: pa.Array) -> np.ndarray:
    """Strings and binaries over their bytes; anything else over its text."""
    kind = values.type
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
        values = values.cast(pa.large_binary())
    elif not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        values = pc.cast(values, pa.string())
    text = values.cast(pa.large_binary()) if not pa.types.is_large_binary(values.type) else values
    filled = pc.fill_null(text, b"")
    return _hash_strings(filled)


def _struct_hashes(values: pa.StructArray) -> np.ndarray:
    total = np.zeros(len(values), np.uint64)
    for i in range(values.type.num_fields):
        field = values.type.field(i)
        child = value_hashes(values.field(i))
        total += np.where(child != 0, _mix(child + text_salt(field.name)), np.uint64(0))
    return _mix(total ^ _STRUCT_TAG)


def _map_as_list(values: pa.MapArray) -> pa.Array:
    entries = pa.StructArray.from_arrays([values.keys, values.items], names=["key", "value"])
    offsets = values.offsets
    return pa.ListArray.from_arrays(offsets, entries, mask=pc.invert(values.is_valid()))


def _list_hashes(values: pa.Array) -> np.ndarray:
    """Sum over each list of (element hash mixed with its position), mixed with the list's length."""
    if pa.types.is_fixed_size_list(values.type):
        values = values.cast(pa.list_(values.type.value_type))
    offsets = np.asarray(values.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    children = value_hashes(values.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
    lengths = np.diff(offsets)
    position = np.arange(len(children), dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lengths)
    terms = _mix(children + position.astype(np.uint64) * _POSITION)
    sums = np.concatenate([np.zeros(1, np.uint64), np.cumsum(terms, dtype=np.uint64)])
    base = offsets - offsets[0]
    per_list = sums[base[1:]] - sums[base[:-1]]
    return _mix(per_list ^ (lengths.astype(np.uint64) * _LIST_TAG))
