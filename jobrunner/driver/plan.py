"""Everything checked before any worker starts: the input files, their columns, the shard plan, the output."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from jobrunner.driver.manifest import check_resumable, new_manifest, resume_manifest
from jobrunner.driver.rows import kept_columns
from jobrunner.driver.shards import Shard, plan_shards
from jobrunner.io.layout import MANIFEST, TEMP_DIR
from jobrunner.io.manifest import clear_success, read_manifest
from jobrunner.io.parts import list_parts
from jobrunner.io.reader import InputError, InputFile, check_columns
from jobrunner.io.storage import Storage, StorageError
from jobrunner.io.text_input import list_input
from jobrunner.spec import JobSpec


class OutputError(ValueError):
    """The output location cannot be used as asked (exists in error mode, unreachable, foreign files)."""


@dataclass
class JobPlan:
    """The input files and the shards cut from them."""

    files: list[InputFile]
    shards: list[Shard]

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
             "id_column": inp.id_column, "sampling_column": inp.sampling_column}
    return {role: column for role, column in roles.items() if column}


def plan_job(spec: JobSpec) -> JobPlan:
    """List the input, check its columns and cut shards; InputError names the URL, file or column."""
    files = list_input(spec.input.url, spec.input.storage_options, spec.input.format)
    keep = spec.output.keep_columns
    check_columns(files, required_columns(spec), [] if keep == "*" else keep)
    check_kept_columns(spec, files)
    if spec.input.id_column is None:
        _check_unique_stems(files)
    plan = JobPlan(files=files, shards=plan_shards([f for f in files if f.num_rows], spec.rows_per_shard))
    if plan.num_rows == 0:
        raise InputError(f"input.url {spec.input.url!r}: the dataset has no rows "
                         f"({len(files)} file(s), all empty)")
    return plan


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


def open_output(spec: JobSpec, plan: JobPlan) -> tuple[Storage, dict[str, Any]]:
    """Prepare the output per output.mode and return it with the manifest to continue from."""
    storage = Storage(spec.output.url, spec.output.storage_options)
    try:
        entries = [e for e in storage.listdir("") if e != TEMP_DIR]
        storage.check_writable()
    except (StorageError, OSError) as exc:
        raise OutputError(f"output.url {spec.output.url!r}: cannot write there: {exc}") from None
    mode = spec.output.mode
    if entries and mode == "error":
        raise OutputError(f"output.url {spec.output.url!r} already exists (output.mode=error)")
    if entries and mode == "overwrite":
        for entry in entries:
            storage.delete(entry, recursive=True)
        entries = []
    manifest = _resume_or_new(spec, plan, storage, entries)
    clear_success(storage)
    storage.delete(TEMP_DIR, recursive=True)
    return storage, manifest


def describe_output(spec: JobSpec, plan: JobPlan) -> str:
    """What a run would do with the output (read-only); OutputError/ResumeError when it would refuse."""
    storage = Storage(spec.output.url, spec.output.storage_options)
    try:
        entries = [e for e in storage.listdir("") if e != TEMP_DIR]
        old = read_manifest(storage) if entries else None
    except (StorageError, OSError) as exc:
        raise OutputError(f"output.url {spec.output.url!r}: cannot access: {exc}") from None
    if not entries:
        return "output is empty: a new job"
    if spec.output.mode == "error":
        raise OutputError(f"output.url {spec.output.url!r} already exists (output.mode=error)")
    if spec.output.mode == "overwrite":
        return "output exists and will be deleted (output.mode=overwrite)"
    if old is None:
        raise _foreign_output(spec)
    check_resumable(old, spec, plan.shards)
    done = sum(e.get("status") == "committed" for e in old["shards"].values())
    return f"output exists: {done}/{len(plan.shards)} shards committed; resume runs the rest"


def _resume_or_new(spec: JobSpec, plan: JobPlan, storage: Storage, entries: list[str]) -> dict[str, Any]:
    if not entries:
        return new_manifest(spec, plan.shards)
    old = read_manifest(storage)
    if old is None:
        raise _foreign_output(spec)
    check_resumable(old, spec, plan.shards)
    return resume_manifest(old, spec, set(list_parts(storage)))


def _foreign_output(spec: JobSpec) -> OutputError:
    return OutputError(f"output.url {spec.output.url!r} has files but no {MANIFEST}: not a jobrunner "
                       "output; use output.mode=overwrite or another output.url")
