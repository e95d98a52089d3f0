"""Reading the input dataset: list Parquet files, read their metadata, check columns, read row ranges."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow as pa
from fsspec.core import url_to_fs

from jobrunner.io.image_parts import parse_content
from jobrunner.io.row_groups import (
    ReadStats,
    RowGroupCache,
    file_stamps,
    parse_footer,
    read_footer_bytes,
    read_range,
)
from jobrunner.io.storage import StorageError, retry
from jobrunner.redaction import redact_text

ROW_INDEX = "__row"  # absolute row number within its file, carried by every row read
ROW_ID = "__id"  # the row id (from id_column or derived)
ROW_ERROR = "__error"  # why a row of a text file could not be read (naming its line), else null
T = TypeVar("T")
R = TypeVar("R")
PROCESS_CACHE = RowGroupCache()  # footers and split row groups this process has read (one per worker)
PROCESS_STATS = ReadStats()  # what read_rows fetched in this process when no `stats` is given (worker stats)


class InputError(ValueError):
    """Bad input data; the message names the URL, file, column or row (credentials cut out)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(str(message)))


@dataclass(frozen=True)
class InputFile:
    """One Parquet file of the dataset and what its footer says."""

    url: str  # protocol-qualified, usable by any process
    stem: str  # file name without .parquet: the prefix of derived row ids
    num_rows: int
    row_group_num_rows: tuple[int, ...]
    column_types: dict[str, str] = field(default_factory=dict)  # name -> Arrow type as text
    num_bytes: int = 0  # file size (for the read-amplification figure)
    # What pins this version of the file (recorded at planning; a resume over a changed file refuses):
    stamps: dict[str, str] = field(default_factory=dict)  # etag / version_id / mtime, as the store gives them
    digest: str = ""  # sha1 of the Parquet footer (row groups, offsets, statistics) or of a text file's bytes
    num_bad_lines: int = 0  # text files: lines that become error rows (not JSON, bad bytes, wrong types)
    first_bad_lines: tuple[str, ...] = ()  # their first few errors, each naming its line


FOOTER_THREADS = 32  # footers are small reads dominated by latency: read many files at once


def list_input_files(url: str, storage_options: dict[str, Any]) -> list[InputFile]:
    """The dataset's Parquet files (a file, a directory, or a glob), sorted, with their metadata."""
    try:
        fs, root = url_to_fs(url, **storage_options)
    except (ImportError, ValueError) as exc:
        raise InputError(f"input.url {url!r}: {exc}") from None
    path_to_size = _expand(fs, url, root)
    if not path_to_size:
        raise InputError(f"input.url {url!r}: no Parquet files found")
    return read_footers(fs, path_to_size)


def read_footers(fs: Any, path_to_size: dict[str, int | None], threads: int | None = None) -> list[InputFile]:
    """The footers of many files, read concurrently (FOOTER_THREADS threads by default), in the order given."""
    return map_files(lambda item: _read_footer(fs, *item), list(path_to_size.items()), threads)


def map_files(fn: Callable[[T], R], items: list[T], threads: int | None = None) -> list[R]:
    """`[fn(x) for x in items]` on a thread pool (FOOTER_THREADS by default): describing input files is a
    few small reads each, dominated by latency. The first error (in item order) is raised."""
    threads = FOOTER_THREADS if threads is None else threads
    if len(items) <= 1 or threads <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        return list(pool.map(fn, items))


PARQUET_SUFFIXES = (".parquet", ".parq")


def _expand(fs: Any, url: str, root: str, suffixes: tuple[str, ...] = PARQUET_SUFFIXES) -> dict[str, int | None]:
    """Paths under the URL with these suffixes, sorted -> size from the listing (None when it gave none)."""
    fs.invalidate_cache()
    try:
        if any(c in root for c in "*?["):
            found = retry(f"glob {url}", lambda: fs.glob(root, detail=True))
        elif retry(f"inspect {url}", lambda: fs.isdir(root)):
            found = retry(f"list {url}", lambda: fs.find(root, detail=True))
        elif retry(f"inspect {url}", lambda: fs.exists(root)):
            found = {root: {}}
        else:
            raise InputError(f"input.url {url!r}: not found")
    except (FileNotFoundError, PermissionError, StorageError) as exc:
        raise InputError(f"input.url {url!r}: cannot list: {exc}") from None
    names = [p for p in sorted(found) if p == root or not _hidden(p, root)]
    keep = [p for p in names if p.endswith(suffixes) or p == root]
    return {p: (found[p] or {}).get("size") for p in keep}


def _hidden(path: str, root: str) -> bool:
    """True for `_x` / `.x` files or files under such folders (e.g. `_temporary/`), below the input root."""
    rel = path[len(root):] if path.startswith(root) else path.rsplit("/", 1)[-1]
    return any(part.startswith(("_", ".")) for part in rel.split("/") if part)


def _read_footer(fs: Any, path: str, size: int | None = None) -> InputFile:
    def read() -> tuple[bytes, int, dict[str, str]]:
        with _open_exact(fs, path) as f:
            num_bytes = size if size is not None else f.seek(0, 2)
            return read_footer_bytes(f, num_bytes) if num_bytes else b"", num_bytes, file_stamps(f)

    url = fs.unstrip_protocol(path)
    try:
        raw, num_bytes, stamps = retry(f"read {url}", read)
        if not num_bytes:  # an empty file (a writer that never finished, a placeholder): no rows, no columns
            return InputFile(url=url, stem=file_stem(path), num_rows=0, row_group_num_rows=(), stamps=stamps)
        meta = parse_footer(raw)
    except (pa.ArrowInvalid, OSError, StorageError) as exc:
        raise InputError(f"input file {url}: not a readable Parquet file ({exc})") from None
    groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    schema = meta.schema.to_arrow_schema()
    types = {name: str(schema.field(name).type) for name in schema.names}
    return InputFile(url=url, stem=file_stem(path), num_rows=meta.num_rows, row_group_num_rows=groups,
                     column_types=types, num_bytes=num_bytes, stamps=stamps,
                     digest=hashlib.sha1(raw).hexdigest()[:20])


def file_stem(path: str) -> str:
    """A file's name without its folder and extension, nor a URL's query (row ids are built from it, and a
    presigned URL's query is a credential)."""
    if "://" in path:
        path = path.split("?", 1)[0].split("#", 1)[0]
    return path.rsplit("/", 1)[-1].rsplit(".", 1)[0]


def _open_exact(fs: Any, path: str) -> Any:
    """Open for reading with no read-ahead, so each read fetches exactly the bytes asked for."""
    try:
        return fs.open(path, "rb", cache_type="none")
    except TypeError:  # a filesystem whose open() takes no cache options
        return fs.open(path, "rb")


# Which Arrow types each role accepts (checked on the type text, so no pyarrow is needed by callers).
def _is_string(t: str) -> bool:
    return t in ("string", "large_string", "string_view")


def _is_id(t: str) -> bool:
    return _is_string(t) or t.startswith(("int", "uint"))


def _is_messages(t: str) -> bool:
    return _is_string(t) or (t.startswith(("list<", "large_list<")) and "struct<" in t)


def _is_overrides(t: str) -> bool:
    return _is_string(t) or t.startswith(("struct<", "map<"))


_ROLE_CHECKS = {
    "prompt_column": (_is_string, "a string column"),
    "messages_column": (_is_messages, "a list<struct<role, content>> column or a JSON string column"),
    "id_column": (_is_id, "a string or integer column"),
    "sampling_column": (_is_overrides, "a struct/map column or a JSON string column"),
    "system_prompt_column": (_is_string, "a string column"),
    "chat_template_kwargs_column": (_is_overrides, "a struct/map column or a JSON string column"),
    "tools_column": (lambda t: _is_string(t) or t.startswith(("list<", "large_list<")),
                     "a list<struct> column or a JSON string column"),
    "adapter_column": (_is_string, "a string column"),
    "image_column": (lambda t: "binary" in t or "string" in t,
                     "a binary or string column, a list of them, or a struct<bytes, path>"),
}


def check_columns(files: list[InputFile], roles: dict[str, str], keep: list[str]) -> None:
    """Fail with InputError naming file and column if a required column is missing or of the wrong type.

    roles: spec field name (e.g. 'prompt_column') -> column name.
    """
    for f in files:
        for role, column in roles.items():
            if column not in f.column_types:
                raise InputError(f"input file {f.url}: missing column {column!r} (input.{role}); "
                                 f"columns are: {', '.join(f.column_types)}")
            ok, expected = _ROLE_CHECKS[role]
            if not ok(f.column_types[column]):
                raise InputError(f"input file {f.url}: column {column!r} (input.{role}) has type "
                                 f"{f.column_types[column]}; expected {expected}")
        for column in keep:
            if column not in f.column_types:
                raise InputError(f"input file {f.url}: missing column {column!r} (output.keep_columns)")
    _check_kept_types(files, keep)


def _check_kept_types(files: list[InputFile], keep: list[str]) -> None:
    """Every part gets one schema, so a kept column must have one type across the input files."""
    for column in keep:
        first = files[0] if files else None
        for f in files[1:]:
            if f.column_types[column] != first.column_types[column]:
                raise InputError(f"output.keep_columns: column {column!r} is {first.column_types[column]} in "
                                 f"{first.url} but {f.column_types[column]} in {f.url}; every output part has "
                                 "one schema, so cast the input to one type")


def read_rows(file_url: str, storage_options: dict[str, Any], row_start: int, row_end: int,
              columns: list[str], stats: ReadStats | None = None,
              cache: RowGroupCache | None = None, pin: dict[str, Any] | None = None) -> pa.Table:
    """Rows [row_start, row_end) of one file, only `columns`, plus ROW_INDEX (the row number in the file).

    Whole row groups are fetched, each column chunk once; footers and split row groups are remembered in
    `cache` (default: one per process, i.e. per worker) so a worker fetches them once (io/row_groups.py).
    `pin` (the file's pin from planning, `file_pin`): InputChanged when the file read is not that version.
    """
    fs, path = url_to_fs(file_url, **storage_options)
    seen: dict[str, Any] = {}

    def read() -> pa.Table:
        return read_range(lambda: _open_exact(fs, path), file_url, row_start, row_end, columns,
                          cache or PROCESS_CACHE, PROCESS_STATS if stats is None else stats, seen)

    try:
        table = retry(f"read {file_url}", read)
    except FileNotFoundError:
        raise InputError(gone_message(file_url)) from None
    except (pa.ArrowInvalid, OSError, StorageError) as exc:
        raise InputError(f"input file {file_url}: cannot read rows {row_start}..{row_end}: {exc}") from None
    if pin:
        check_pin(file_url, pin, seen.get("size"), seen.get("stamps") or {}, lambda: _footer_digest(fs, path))
    return table.append_column(ROW_INDEX, pa.array(range(row_start, row_start + table.num_rows), pa.int64()))


# ---- pins: the version of each input file that planning saw -----------------------------------------
class InputChanged(InputError):
    """An input file is not the version planning pinned (rewritten after the job was planned)."""


def file_pin(f: InputFile) -> dict[str, Any]:
    """What a worker checks a file against before using its rows: size, ETag / version id / mtime, digest."""
    return {"bytes": f.num_bytes, **f.stamps, "digest": f.digest}


def pin_changes(pin: dict[str, Any], size: int | None, stamps: dict[str, str],
                digest: Callable[[], str] | None = None) -> list[str]:
    """What differs between a pin and the file as read now ([] = the same version). Size and ETag (or, with
    no ETag, the version id) decide; a changed mtime alone (a file copied back in place) is a change only when
    the digest differs too (`digest` is called only then)."""
    differ = []
    if pin.get("bytes") is not None and size is not None and pin["bytes"] != size:
        differ.append(f"size {pin['bytes']} -> {size} bytes")
    key = "etag" if pin.get("etag") and stamps.get("etag") else "version_id"
    if pin.get(key) and stamps.get(key) and pin[key] != stamps[key]:
        differ.append(f"{'ETag' if key == 'etag' else 'version id'} {pin[key]} -> {stamps[key]}")
    old_t, new_t = pin.get("mtime"), stamps.get("mtime")
    if not differ and old_t and new_t and old_t != new_t and not pin.get("etag") and pin.get("digest") and digest:
        if digest() != pin["digest"]:
            differ.append(f"content differs, modified {old_t} -> {new_t}")
    return differ


def check_pin(url: str, pin: dict[str, Any], size: int | None, stamps: dict[str, str],
              digest: Callable[[], str] | None = None) -> None:
    """InputChanged naming the file and what changed, unless it is the pinned version."""
    differ = pin_changes(pin, size, stamps, digest)
    if differ:
        raise InputChanged(changed_message(url, differ))


def changed_message(url: str, differ: list[str]) -> str:
    """What a worker says when a file was rewritten between planning and its read."""
    return (f"input file {url} changed after the job was planned ({', '.join(differ)}): its rows are not the "
            "planned ones, so this shard is not run on them. Put the original file back and run the job "
            "again (it resumes), or start over with output.mode=overwrite")


def _footer_digest(fs: Any, path: str) -> str:
    with _open_exact(fs, path) as f:
        return hashlib.sha1(read_footer_bytes(f, f.seek(0, 2))).hexdigest()[:20]


def gone_message(url: str) -> str:
    """What a worker says when an input file planned into the job is no longer there."""
    return (f"input file {url} is gone (deleted or moved after the job was planned); put it back (the same "
            "file) and run the job again: it resumes")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """A messages cell (list of structs, or a JSON string) as a list of {role, content} dicts; a content list of
    parts stays a list where it holds images (``{"type": "image", "image": ImageRef}``), else becomes text."""
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        content_ok = isinstance(content, (str, list)) or (calls and content is None)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not content_ok:
            raise ValueError("each message needs string 'role' and 'content' (a string or a list of parts)")
        if isinstance(content, list):  # OpenAI content parts: text and image_url (io/image_parts.py)
            content = parse_content(content, f"messages[{i}].content")
        message = {"role": m["role"], "content": content}
        # an agent trace: an assistant turn's calls, a tool result's call id and name (as OpenAI writes them)
        message.update({k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None})
        out.append(message)
    return out


def parse_overrides(value: Any) -> dict[str, Any]:
    """A per-row sampling override cell (JSON object string, struct or map) as a dict; None = no override."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        value = json.loads(value)
    if isinstance(value, list):  # Arrow maps arrive as [(key, value), ...]
        try:
            value = dict(value)
        except (TypeError, ValueError):
            raise ValueError("sampling overrides must be a JSON object or a map") from None
    if not isinstance(value, dict):
        raise ValueError(f"sampling overrides must be a JSON object, got {type(value).__name__}")
    return {k: v for k, v in value.items() if v is not None}
