"""Everything checked before any worker starts: the input files, their columns, the shard plan, the output."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from jobrunner.driver.incremental import IncrementalPlan
from jobrunner.driver.prefix_plan import PrefixPlan, check_prefix_column, plan_prefix_shards
from jobrunner.driver.rows import id_column, is_openai_batch, kept_columns
from jobrunner.driver.shards import ShardTable, plan_shards
from jobrunner.io.ids import Duplicate
from jobrunner.io.reader import InputError, InputFile, check_columns
from jobrunner.io.text_input import find_input_duplicates, list_input, row_location
from jobrunner.redaction import redacting_logger
from jobrunner.spec import JobSpec

MAX_LISTED_DUPLICATES = 5
MAX_LISTED_EMPTY = 5
log = redacting_logger(__name__)


@dataclass
class JobPlan:
    """The input files and the shards cut from them (one table: columns, not an object per shard)."""

    files: list[InputFile]
    shards: ShardTable
    prefix: PrefixPlan | None = None  # how rows were grouped by prompt prefix (driver/prefix_plan.py)
    incremental: IncrementalPlan | None = None  # output.mode incremental: what this run takes (under the lease)
    stage: bool = False  # a pipeline stage after the first: its shards come from its feed (driver/stage_feed.py)

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.files)


def with_absolute_output(spec: JobSpec) -> JobSpec:
    """The spec with a relative local output path made absolute (workers may run in another directory)."""
    url = spec.output.url
    if "://" in url or os.path.isabs(url):
        return spec
    output = spec.output.model_copy(update={"url": os.path.abspath(url)})
    return spec.model_copy(update={"output": output})


def required_columns(spec: JobSpec) -> dict[str, str]:
    """Spec field name -> input column, for the columns the job reads."""
    inp = spec.input
    roles = {"prompt_column": inp.prompt_column, "messages_column": inp.messages_column,
             "id_column": inp.id_column, "sampling_column": inp.sampling_column,
             "system_prompt_column": inp.system_prompt_column,
             "chat_template_kwargs_column": inp.chat_template_kwargs_column, "tools_column": inp.tools_column,
             "adapter_column": inp.adapter_column, "image_column": inp.image_column}
    return {role: column for role, column in roles.items() if column}


def plan_job(spec: JobSpec, old_manifest: dict[str, Any] | None = None) -> JobPlan:
    """List the input, check its columns and cut shards; InputError names the URL, file or column.

    old_manifest: the header of the manifest this run resumes (`driver/output.read_previous_output`), None for
    a new output: an output planned before prefix grouping existed keeps its plain shards."""
    files = list_input(spec.input.url, spec.input.storage_options, spec.input.format)
    if spec.input.limit is not None:
        files = first_rows(files, spec.input.limit)
    with_rows = files_with_rows(spec, files)
    keep = spec.output.keep_columns
    check_columns(with_rows, required_columns(spec), [] if keep == "*" else keep)
    check_kept_columns(spec, with_rows)
    check_prefix_column(spec, with_rows)
    if spec.input.id_column is None:
        _check_unique_stems(with_rows)
    if spec.output.mode == "incremental":  # shards are cut under the output's lease (driver/incremental.py)
        shards, prefix = plan_shards([], spec.rows_per_shard), None
    else:
        shards, prefix = plan_prefix_shards(spec, with_rows, old_manifest)
    check_unique_ids(spec, with_rows)
    # every file stays in the plan: its pin (io/reader.file_pin) lets a resume notice rows added to it later
    return JobPlan(files=files, shards=shards, prefix=prefix)


def files_with_rows(spec: JobSpec, files: list[InputFile]) -> list[InputFile]:
    """The files that hold rows. Empty ones (0 bytes, 0 rows, no columns) are skipped with one warning naming
    them, and are not checked for columns; InputError naming them when no file is left."""
    empty = [f for f in files if not f.num_rows]
    if len(empty) == len(files):
        raise InputError(f"input.url {spec.input.url!r}: the dataset has no rows: every input file is empty "
                         f"({describe_empty(empty)})")
    if empty:
        log.warning("input.url %r: skipping %d empty input file(s): %s", spec.input.url, len(empty),
                    describe_empty(empty))
    return [f for f in files if f.num_rows]


def describe_empty(files: list[InputFile]) -> str:
    """'a.parquet (0 bytes), b.parquet (0 rows, no columns) and 3 more': the first MAX_LISTED_EMPTY files."""
    def why(f: InputFile) -> str:
        return "0 bytes" if not f.num_bytes and not f.column_types else \
            "0 rows" + ("" if f.column_types else ", no columns")

    shown = ", ".join(f"{f.url} ({why(f)})" for f in files[:MAX_LISTED_EMPTY])
    return shown + (f" and {len(files) - MAX_LISTED_EMPTY} more" if len(files) > MAX_LISTED_EMPTY else "")


def first_rows(files: list[InputFile], limit: int) -> list[InputFile]:
    """The files cut to their first `limit` rows in all (files in listing order, which is sorted; rows in file
    order): the same rows every time. Files past the limit are left out; the last kept one is cut inside its
    row groups."""
    out: list[InputFile] = []
    left = limit
    for f in files:
        if left <= 0:
            break
        if f.num_rows <= left:
            out.append(f)
            left -= f.num_rows
            continue
        groups, need = [], left
        for n in f.row_group_num_rows:
            groups.append(min(n, need))
            need -= groups[-1]
            if need == 0:
                break
        out.append(dataclasses.replace(f, num_rows=left, row_group_num_rows=tuple(groups)))
        left = 0
    return out


def check_unique_ids(spec: JobSpec, files: list[InputFile]) -> None:
    """InputError naming the first repeated ids (file and row or line of both rows) when an id appears
    twice: every input id must come out exactly once. A null id counts as the id its row gets,
    `<file-stem>:<row>`, so a real id equal to it is refused too. Derived ids (no id column) are unique by
    construction. Reads the id column once (io/ids.py: memory bounded at any row count)."""
    column = id_column(spec)
    if column is None:
        return
    inp = spec.input
    dups = find_input_duplicates(files, inp.storage_options, inp.format, column, MAX_LISTED_DUPLICATES + 1)
    if not dups:
        return
    shown = "; ".join(_describe_duplicate(d, files, spec) for d in dups[:MAX_LISTED_DUPLICATES])
    more = " (and more)" if len(dups) > MAX_LISTED_DUPLICATES else ""
    if is_openai_batch(spec):
        raise InputError(f"the batch repeats a custom_id: {shown}{more}. Every custom_id must be unique in a "
                         "batch (OpenAI refuses such a file too); fix the input")
    if any(any(d.derived) for d in dups):
        raise InputError(f"input.id_column {column!r}: a null id's derived id is another row's id: {shown}{more}. A "
                         "row with a null id is named '<file-stem>:<row>' (and made an error row), so no other row "
                         "may carry that id; give the null ids values, or rename the other row")
    raise InputError(f"input.id_column {column!r} has duplicate ids: {shown}{more}. Every id must be unique "
                     "(each comes out exactly once); fix the input, or leave input.id_column unset to use "
                     "'<file-stem>:<row>' ids")


def _describe_duplicate(dup: Duplicate, files: list[InputFile], spec: JobSpec) -> str:
    def where(at: tuple[int, int], derived: bool) -> str:
        place = row_location(files[at[0]], at[1], spec.input.storage_options, spec.input.format)
        return place + (" (a null id, derived)" if derived else "")

    return f"{dup.row_id!r} at {where(dup.first, dup.derived[0])} and again at {where(dup.again, dup.derived[1])}"


def check_kept_columns(spec: JobSpec, files: list[InputFile]) -> None:
    """output.keep_columns (or '*') against each file's columns: InputError names a clash with an output
    column, before any worker starts."""
    for f in files:
        try:
            kept_columns(spec, list(f.column_types))
        except ValueError as exc:
            raise InputError(f"input file {f.url}: {exc}") from None


def _check_unique_stems(files: list[InputFile]) -> None:
    """Derived ids are '<file-stem>:<row>', so two files with one stem would give two rows one id."""
    by_stem: dict[str, str] = {}
    for f in files:
        if f.stem in by_stem:
            raise InputError(f"input files {by_stem[f.stem]} and {f.url} have the same name {f.stem!r}, so "
                             "derived row ids would collide; set input.id_column")
        by_stem[f.stem] = f.url

