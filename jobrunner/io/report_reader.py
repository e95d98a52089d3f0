"""Streamed, column-projected reading of a job's outputs for reports (and writing the report files).

Only the metric columns of `docs/contracts.md` are read, one Parquet row group at a time and handed out in
record batches, so a 10-million-row output never sits whole in memory: the caller folds each `MetricBatch`
into bounded accumulators. `generated_text` and kept input columns are never
decoded. This module owns every pyarrow / fsspec call made for reports; `jobrunner.reports` only sees numpy
arrays, dicts and strings.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from jobrunner.io.commits import is_stale
from jobrunner.io.layout import (
    COMMITS_DIR,
    LEASE,
    LEASE_GENERATION,
    MANIFEST,
    PARTS_DIR,
    READABLE_MANIFEST_VERSIONS,
    RUNS_DIR,
    SUCCESS,
    part_key,
)
from jobrunner.io.manifest import ManifestError, read_manifest_table, read_manifest_with_records
from jobrunner.io.run_records import fold_run_records, parse_run_records
from jobrunner.io.shard_file import COMMITTED, STATUS_VALUES, ShardColumns
from jobrunner.io.storage import Storage
from jobrunner.url_templates import PLACEHOLDER

TOKEN_COLUMNS = ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens")
LATENCY_COLUMNS = ("ttft_s", "itl_mean_s", "e2e_s", "queue_s")
STRING_COLUMNS = ("finish_reason", "error")
JSON_VALID_COLUMN = "json_valid"  # only in jobs whose rows can have a JSON schema
REASONING_TOKENS_COLUMN = "num_reasoning_tokens"  # only in jobs with a reasoning parser
ADAPTER_COLUMN = "adapter"  # only in jobs whose rows name a LoRA adapter (null: the base model)
BASE_MODEL = "(base model)"  # how the report names rows that ran without an adapter
ADAPTER_FIGURES = ("rows", "errors", *TOKEN_COLUMNS)  # per adapter, summed over the job
SHARED_PROMPT_COLUMN = "prompt_shared"  # sample i > 0 of a row: its prompt tokens were computed for sample 0
IMAGES_COLUMN, IMAGE_TOKENS_COLUMN = "num_images", "num_image_tokens"  # only in jobs whose rows can carry images
# per batch, over prompts (sibling samples of one row counted once): prompts, images, rows with an image, most
# images in one row, image tokens, the images of rows with image tokens (those the model read: not an error row's),
# rows with images whose engine reported no image-token count
IMAGE_FIGURES = ("prompts", "images", "image_rows", "max_images", "image_tokens", "images_with_tokens",
                 "image_rows_unreported")
# Everything a report reads from a part; never `generated_text` or kept input columns.
METRIC_COLUMNS = TOKEN_COLUMNS + LATENCY_COLUMNS + ("finish_time_s",) + STRING_COLUMNS


class ReportInputError(ValueError):
    """The output URL holds nothing a report can be built from (message says why, for the user)."""


class NothingCommittedYet(ReportInputError):
    """A job output whose shards are planned but none committed yet (running, or stopped before its first
    commit); a trend skips it with a warning instead of failing."""


@dataclass
class JobOutputs:
    """Where a job's outputs are and what its manifest says; built by `open_outputs`."""

    url: str
    fs: fsspec.AbstractFileSystem
    root: str
    manifest: dict | None
    part_paths: list[str]
    is_complete: bool
    warnings: list[str] = field(default_factory=list)
    shards: ShardColumns | None = None  # the shard table of a format 3 manifest (records folded in)


@dataclass
class MetricBatch:
    """One record batch of metric columns as numpy arrays (nulls: 0 for counts, NaN for seconds)."""

    num_prompt_tokens: np.ndarray  # int64 [n]
    num_cached_tokens: np.ndarray  # int64 [n]
    num_output_tokens: np.ndarray  # int64 [n]
    ttft_s: np.ndarray  # float64 [n]
    itl_mean_s: np.ndarray
    e2e_s: np.ndarray
    queue_s: np.ndarray
    finish_time_s: np.ndarray
    is_error: np.ndarray  # bool [n]: `error` set or finish_reason == "error"
    error_to_count: dict[str, int]  # distinct error strings of this batch
    finish_reason_to_count: dict[str, int]
    json_valid_to_count: dict[bool, int] = field(default_factory=dict)  # rows with json_valid true / false
    num_reasoning_tokens: int | None = None  # this batch's reasoning tokens; None: the part has no such column
    # adapter (BASE_MODEL for none) -> ADAPTER_FIGURES of its rows; None: the part has no adapter column
    adapter_figures: dict[str, list[int]] | None = None
    image_figures: dict[str, int] | None = None  # IMAGE_FIGURES; None: the part has no num_images column

    @property
    def num_rows(self) -> int:
        """Rows in this batch."""
        return len(self.is_error)


def open_outputs(url: str, storage_options: dict | None = None) -> JobOutputs:
    """Locate the manifest and committed parts under `url`; raise `ReportInputError` if there are none."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ValueError, ImportError, TypeError) as exc:
        raise ReportInputError(f"{url}: cannot open this URL ({exc})") from exc
    root = root.rstrip("/") or "/"
    manifest = _read_manifest(fs, root, url)
    outputs = JobOutputs(url=url, fs=fs, root=root, manifest=manifest, part_paths=[],
                         is_complete=fs.exists(posixpath.join(root, SUCCESS)))
    if manifest is not None and "shard_table" in manifest and not isinstance(manifest.get("shards"), dict):
        outputs.shards = _read_shard_table(url, storage_options, manifest)
    outputs.part_paths = _part_paths(outputs)
    if not outputs.part_paths and not planned_nothing(outputs):
        error = NothingCommittedYet if outputs.manifest is not None else ReportInputError
        raise error(_no_parts_message(outputs))
    return outputs


def planned_nothing(outputs: JobOutputs) -> bool:
    """Whether the output's runs planned no shard at all (an incremental night with no new row, an empty
    input): a valid output of zero rows, reported as such."""
    if outputs.manifest is None:
        return False
    if outputs.shards is not None:
        return len(outputs.shards) == 0
    return outputs.manifest.get("shards") == {}


def _read_manifest(fs: fsspec.AbstractFileSystem, root: str, url: str) -> dict | None:
    path = posixpath.join(root, MANIFEST)
    if not fs.exists(path):
        return None
    try:
        manifest = json.loads(fs.cat_file(path))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{url}: {MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise ReportInputError(f"{url}: {MANIFEST} is not a JSON object")
    version = manifest.get("format_version")
    if version not in READABLE_MANIFEST_VERSIONS:
        readable = ", ".join(str(v) for v in READABLE_MANIFEST_VERSIONS)
        raise ReportInputError(
            f"{url}: {MANIFEST} has format_version {version!r} (written by jobrunner "
            f"{manifest.get('jobrunner_version', 'unknown')}); this jobrunner reads format_version "
            f"{readable}. Use the jobrunner version that wrote it.")
    _fold_commit_records(fs, root, manifest)
    _fold_run_records(fs, root, manifest)
    return manifest


def _fold_run_records(fs: fsspec.AbstractFileSystem, root: str, manifest: dict) -> None:
    """Runs stopped before their end (Ctrl-C, kill -9, a takeover) are missing from the manifest: fold in
    their `_runs/` records, so their workers' seconds are priced (io/run_records.py)."""
    try:
        paths = fs.glob(posixpath.join(root, RUNS_DIR, "*.json"))
        blobs = fs.cat(paths, on_error="return") if paths else {}
    except (FileNotFoundError, OSError):
        return
    fold_run_records(manifest, parse_run_records([b for b in blobs.values() if isinstance(b, bytes)]))


def _fold_commit_records(fs: fsspec.AbstractFileSystem, root: str, manifest: dict) -> None:
    """A running (or crashed) job's manifest lags its commits: fold in the `_commits/` records it lacks."""
    shards = manifest.get("shards")
    if not isinstance(shards, dict):
        return
    try:
        paths = fs.glob(posixpath.join(root, COMMITS_DIR, "*.json"))
    except (FileNotFoundError, OSError):
        return
    todo = [p for p in paths if (shards.get(posixpath.basename(p)[:-5]) or {}).get("status") != "committed"]
    for path, data in (fs.cat(todo, on_error="return") if todo else {}).items():
        try:
            record = json.loads(data) if isinstance(data, bytes) else None
        except ValueError:
            continue
        if (isinstance(record, dict) and record.get("status") == "committed"
                and not is_stale(record, manifest.get(LEASE_GENERATION))):
            shards[posixpath.basename(path)[:-5]] = record


def _read_shard_table(url: str, storage_options: dict | None, manifest: dict) -> ShardColumns:
    """A format 3 manifest's shard table with the commit records it lacks; refreshes its status counts."""
    try:
        found = read_manifest_table(Storage(url, storage_options))
    except (ManifestError, OSError, ValueError) as exc:
        raise ReportInputError(f"{url}: cannot read the manifest's shard table ({exc})") from exc
    if found is None:
        raise ReportInputError(f"{url}: {MANIFEST} disappeared while reading it")
    columns = found[1]
    counts = np.bincount(columns.status, minlength=len(STATUS_VALUES))
    table = manifest.setdefault("shard_table", {})
    table["status_counts"] = {status: int(counts[i]) for i, status in enumerate(STATUS_VALUES)}
    return columns


def _part_paths(outputs: JobOutputs) -> list[str]:
    """Committed parts named by the manifest, else every `parts/*.parquet` (a manifest-less output)."""
    if outputs.shards is not None:
        return _table_part_paths(outputs, outputs.shards)
    shards = (outputs.manifest or {}).get("shards") or {}
    if not isinstance(shards, dict) or not shards:
        pattern = posixpath.join(outputs.root, PARTS_DIR, "*.parquet")
        return sorted(outputs.fs.glob(pattern))
    paths = []
    for shard_id, shard in sorted(shards.items()):
        if not isinstance(shard, dict) or shard.get("status") != "committed":
            continue
        parts = shard.get("parts") if isinstance(shard.get("parts"), list) else None
        paths += _present_parts(outputs, shard_id, parts or [shard.get("part") or part_key(shard_id)])
    return paths


def _table_part_paths(outputs: JobOutputs, columns: ShardColumns) -> list[str]:
    committed = np.flatnonzero(columns.status == COMMITTED)
    paths = []
    for index in committed[np.argsort(columns.shard_id[committed], kind="stable")].tolist():
        paths += _present_parts(outputs, columns.id_of(index), columns.parts_of(index))
    return paths


def _present_parts(outputs: JobOutputs, shard_id: str, parts: list[str]) -> list[str]:
    """The paths of a committed shard's parts that exist (a missing one is a warning in the report)."""
    paths = []
    for part in parts:
        path = posixpath.join(outputs.root, part)
        if outputs.fs.exists(path):
            paths.append(path)
        else:
            outputs.warnings.append(f"shard {shard_id}: committed part {part} is missing; skipped")
    return paths


def _no_parts_message(outputs: JobOutputs) -> str:
    if outputs.manifest is None:
        return (f"{outputs.url}: no jobrunner outputs here (no {MANIFEST} and no "
                f"{PARTS_DIR}/*.parquet). Is this the job's output URL?")
    return f"{outputs.url}: the manifest lists no committed shard with a readable part yet"


def iter_metric_batches(outputs: JobOutputs, batch_rows: int = 65_536) -> Iterator[MetricBatch]:
    """Yield the metric columns of every committed part, one row group at a time, `batch_rows` rows a batch.

    Row group by row group on purpose: `ParquetFile.iter_batches` kept every decoded column chunk alive
    (resident memory grew by ~80 MB per float column over 10 M rows); this loop stays at one row group.
    """
    for path in outputs.part_paths:
        with _open_for_ranges(outputs.fs, path) as fh:
            parquet = pq.ParquetFile(fh)
            _check_columns(parquet.schema_arrow, path)
            columns = list(METRIC_COLUMNS) + _optional_columns(parquet.schema_arrow)
            for index in range(parquet.metadata.num_row_groups):
                table = parquet.read_row_group(index, columns=columns, use_threads=False)
                for batch in table.to_batches(max_chunksize=batch_rows):
                    yield _to_metric_batch(batch)


def _open_for_ranges(fs: fsspec.AbstractFileSystem, path: str):
    """Open without read-ahead where the filesystem allows it: pyarrow asks for exactly the byte ranges of the
    metric column chunks, and a read-ahead block would also fetch the `generated_text` bytes around them."""
    try:
        return fs.open(path, "rb", cache_type="none")
    except TypeError:  # a filesystem whose open() takes no cache options
        return fs.open(path, "rb")


def _check_columns(schema: pa.Schema, path: str) -> None:
    missing = [name for name in METRIC_COLUMNS if schema.get_field_index(name) < 0]
    if missing:
        raise ReportInputError(f"{path}: not a jobrunner output part (missing columns: {', '.join(missing)})")


def _optional_columns(schema: pa.Schema) -> list[str]:
    """Metric columns older parts (or jobs without JSON schemas) may lack."""
    return [name for name in (SHARED_PROMPT_COLUMN, JSON_VALID_COLUMN, REASONING_TOKENS_COLUMN, ADAPTER_COLUMN,
                              IMAGES_COLUMN, IMAGE_TOKENS_COLUMN) if schema.get_field_index(name) >= 0]


def _to_metric_batch(batch: pa.RecordBatch) -> MetricBatch:
    shared = None
    if SHARED_PROMPT_COLUMN in batch.schema.names:
        shared = pc.fill_null(batch.column(SHARED_PROMPT_COLUMN), False)

    def counts(name: str) -> np.ndarray:
        column = pc.fill_null(batch.column(name).cast(pa.int64()), 0)
        if shared is not None and name in ("num_prompt_tokens", "num_cached_tokens"):
            column = pc.if_else(shared, 0, column)  # a prompt shared by sibling samples counts once per row
        return column.to_numpy(zero_copy_only=False)

    def seconds(name: str) -> np.ndarray:
        column = pc.fill_null(batch.column(name).cast(pa.float64()), float("nan"))
        return column.to_numpy(zero_copy_only=False)

    error = batch.column("error")
    finish_reason = batch.column("finish_reason")
    is_error = pc.or_(pc.is_valid(error), pc.fill_null(pc.equal(finish_reason, "error"), False))
    tokens = {name: counts(name) for name in TOKEN_COLUMNS}
    is_error = is_error.to_numpy(zero_copy_only=False)
    return MetricBatch(
        **tokens,
        **{name: seconds(name) for name in (*LATENCY_COLUMNS, "finish_time_s")},
        is_error=is_error,
        error_to_count=_value_counts(error),
        finish_reason_to_count=_value_counts(finish_reason),
        json_valid_to_count=_value_counts(batch.column(JSON_VALID_COLUMN)) if JSON_VALID_COLUMN in batch.schema.names
        else {},
        num_reasoning_tokens=int(pc.sum(batch.column(REASONING_TOKENS_COLUMN)).as_py() or 0)
        if REASONING_TOKENS_COLUMN in batch.schema.names else None,
        adapter_figures=_adapter_figures(batch.column(ADAPTER_COLUMN), is_error, tokens)
        if ADAPTER_COLUMN in batch.schema.names else None,
        image_figures=_image_figures(batch, shared) if IMAGES_COLUMN in batch.schema.names else None,
    )


def _image_figures(batch: pa.RecordBatch, shared: pa.Array | None) -> dict[str, int]:
    """IMAGE_FIGURES of a batch; a sample whose prompt a sibling computed (prompt_shared) is left out."""
    images = pc.fill_null(batch.column(IMAGES_COLUMN).cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
    tokens = batch.column(IMAGE_TOKENS_COLUMN) if IMAGE_TOKENS_COLUMN in batch.schema.names else None
    known = np.zeros(len(images), bool) if tokens is None else \
        np.asarray(pc.is_valid(tokens).to_numpy(zero_copy_only=False), bool)
    counts = np.zeros(len(images), np.int64) if tokens is None else \
        pc.fill_null(tokens.cast(pa.int64()), 0).to_numpy(zero_copy_only=False)
    own = np.ones(len(images), bool) if shared is None else ~np.asarray(shared.to_numpy(zero_copy_only=False), bool)
    with_images = own & (images > 0)
    return {"prompts": int(own.sum()), "images": int(images[own].sum()), "image_rows": int(with_images.sum()),
            "max_images": int(images[own].max(initial=0)), "image_tokens": int(counts[own].sum()),
            "images_with_tokens": int(images[own & (counts > 0)].sum()),
            "image_rows_unreported": int((with_images & ~known).sum())}


def _adapter_figures(adapter: pa.Array, is_error: np.ndarray, tokens: dict[str, np.ndarray]
                     ) -> dict[str, list[int]]:
    """Per adapter (null: BASE_MODEL): rows, errors and the token counts of its rows."""
    names = np.asarray(pc.fill_null(adapter, BASE_MODEL).to_pylist(), dtype=object)
    out = {}
    for name in sorted(set(names.tolist())):
        mine = names == name
        out[name] = [int(mine.sum()), int(is_error[mine].sum()), *(int(tokens[t][mine].sum()) for t in TOKEN_COLUMNS)]
    return out


def _value_counts(column: pa.Array) -> dict[str, int]:
    valid = pc.drop_null(column)
    if len(valid) == 0:
        return {}
    pairs = pc.value_counts(valid)
    return dict(zip(pairs.field("values").to_pylist(), pairs.field("counts").to_pylist(), strict=True))


def write_report_files(url: str, name_to_text: dict[str, str],
                       storage_options: dict | None = None) -> list[str]:
    """Write each `name -> text` under the output URL (e.g. _report/report.json); return the paths."""
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    paths = []
    for name, text in name_to_text.items():
        path = posixpath.join(root, name)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        fs.pipe_file(path, text.encode("utf-8"))
        paths.append(fs.unstrip_protocol(path))
    return paths


def write_text(url: str, text: str, storage_options: dict | None = None) -> None:
    """Write `text` to one file at any fsspec URL or local path (used by `jobrunner report --out`)."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    parent = posixpath.dirname(path)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(path, text.encode("utf-8"))


@dataclass
class OutputState:
    """What `jobrunner status` reads from an output: the manifest (records folded), the lease, `_SUCCESS`."""

    url: str
    manifest: dict | None
    lease: dict | None
    is_complete: bool
    num_commit_records: int = 0


def read_output_state(url: str, storage_options: dict | None = None) -> OutputState:
    """Manifest (with `_commits/` records folded in), `_lease.json` and `_SUCCESS` of one output.

    Never reads a part. `ReportInputError` when the URL holds neither a manifest nor a lease."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ValueError, ImportError, TypeError) as exc:
        raise ReportInputError(f"{url}: cannot open this URL ({exc})") from exc
    root = root.rstrip("/") or "/"
    manifest = _read_manifest(fs, root, url)
    if manifest is not None and "shards" not in manifest and "shard_table" in manifest:
        manifest = _with_shard_entries(url, storage_options, manifest)
    lease = _read_json_or_none(fs, posixpath.join(root, LEASE))
    if manifest is None and lease is None:
        raise ReportInputError(f"{url}: no {MANIFEST} and no {LEASE} here: no job has written to this output "
                               "yet (is this the job's output.url?)")
    try:
        records = len(fs.glob(posixpath.join(root, COMMITS_DIR, "*.json")))
    except (FileNotFoundError, OSError):
        records = 0
    return OutputState(url=url, manifest=manifest, lease=lease, num_commit_records=records,
                       is_complete=fs.exists(posixpath.join(root, SUCCESS)))


def _with_shard_entries(url: str, storage_options: dict | None, manifest: dict) -> dict:
    """A format 3 manifest with its shard table as `"shards": {id: entry}` (records folded in), for status."""
    try:
        found = read_manifest_with_records(Storage(url, storage_options))
    except (ManifestError, OSError, ValueError) as exc:
        raise ReportInputError(f"{url}: cannot read the manifest's shard table ({exc})") from exc
    return found if found is not None else manifest


def _read_json_or_none(fs: fsspec.AbstractFileSystem, path: str) -> dict | None:
    """A small JSON object, or None when absent, torn or not an object."""
    try:
        data = json.loads(fs.cat_file(path))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


GLOB_CHARS = "*?["


def expand_output_urls(patterns: list[str], storage_options: dict | None = None) -> tuple[list[str], bool]:
    """Each pattern as is, or (when it holds * ? [) the job outputs it matches, sorted: folders with a
    `_manifest.json` or a `parts/` folder. Returns (urls, whether any pattern was a glob);
    `ReportInputError` names a glob that matches no output."""
    urls: list[str] = []
    globbed = False
    for pattern in patterns:
        pattern = PLACEHOLDER.sub("*", pattern)  # a templated output URL as written: every night it named
        if not any(ch in pattern for ch in GLOB_CHARS):
            nights = _child_outputs(pattern, storage_options)
            urls += nights or [pattern]
            globbed = globbed or bool(nights)
            continue
        globbed = True
        fs, path = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
        found = [p for p in sorted(fs.glob(path.rstrip("/"))) if _is_output(fs, p)]
        if not found:
            raise ReportInputError(f"{pattern}: matches no job output (no folder with {MANIFEST} or {PARTS_DIR}/)")
        urls += [_url_of(fs, p) for p in found]
    return urls, globbed


def _child_outputs(url: str, storage_options: dict | None) -> list[str]:
    """The job outputs directly under ``url`` when it is a root of dated outputs (``out/nightly`` holding
    ``2026-12-01/``, ``2026-12-02/``...) rather than an output itself; [] otherwise (or if it cannot be
    listed: opening it reports the problem)."""
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        path = path.rstrip("/") or "/"
        if _is_output(fs, path) or not fs.isdir(path):
            return []
        children = sorted(p for p in fs.ls(path, detail=False) if fs.isdir(p))
    except (OSError, ValueError, ImportError, TypeError):
        return []
    return [_url_of(fs, p) for p in children if _is_output(fs, p)]


def _url_of(fs: fsspec.AbstractFileSystem, path: str) -> str:
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    return path if local else fs.unstrip_protocol(path)


def _is_output(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    return fs.exists(posixpath.join(path, MANIFEST)) or fs.isdir(posixpath.join(path, PARTS_DIR))
