"""The output location: checked, leased to this run, then prepared per `output.mode`.

One run per output: the lease (`io/lease.py`) is taken before anything under the output changes. `overwrite`
deletes only a prefix that is empty or holds an earlier output of the same job (see driver/output_guard.py).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from jobrunner.driver.manifest import check_resumable, new_manifest, orphan_parts, resume_manifest
from jobrunner.driver.output_guard import overwrite_refusal
from jobrunner.io.layout import LEASE, MANIFEST, TEMP_DIR
from jobrunner.io.lease import Lease, LeaseHeld, acquire_lease, describe_holder, is_expired, read_lease
from jobrunner.io.manifest import clear_success, read_manifest_with_records
from jobrunner.io.parts import list_parts
from jobrunner.io.storage import Storage, StorageError
from jobrunner.redaction import redact_text
from jobrunner.spec import JobSpec

if TYPE_CHECKING:
    from jobrunner.driver.plan import JobPlan


class OutputError(ValueError):
    """The output location cannot be used as asked (exists in error mode, unreachable, foreign files)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(str(message)))


def open_output(spec: JobSpec, plan: JobPlan) -> tuple[Storage, dict[str, Any], Lease]:
    """Check the output, take its lease, prepare it per output.mode; the manifest to continue from."""
    storage = Storage(spec.output.url, spec.output.storage_options)
    mode = spec.output.mode
    try:
        entries = _entries(storage)
        if mode == "overwrite":  # before the probe write: nothing is written into a folder overwrite refuses
            check_overwrite(spec, storage, entries, plan)
        storage.check_writable()
    except (StorageError, OSError) as exc:
        raise OutputError(f"output.url {spec.output.url!r}: cannot write there: {exc}") from None
    if entries and mode == "error":
        raise OutputError(f"output.url {spec.output.url!r} already exists (output.mode=error)")
    try:
        lease = acquire_lease(storage, uuid.uuid4().hex[:12], spec.output.lease_ttl_s, spec.name)
    except LeaseHeld as exc:
        raise OutputError(str(exc)) from None
    try:
        manifest = _prepare(spec, plan, storage, entries)
    except BaseException:
        lease.release()
        raise
    return storage, manifest, lease


def _entries(storage: Storage) -> list[str]:
    return [e for e in storage.listdir("") if e not in (TEMP_DIR, LEASE)]


def _prepare(spec: JobSpec, plan: JobPlan, storage: Storage, entries: list[str]) -> dict[str, Any]:
    if entries and spec.output.mode == "overwrite":
        for entry in entries:
            storage.delete(entry, recursive=True)
        entries = []
    manifest = _resume_or_new(spec, plan, storage, entries)
    clear_success(storage)
    storage.delete(TEMP_DIR, recursive=True)
    return manifest


def check_overwrite(spec: JobSpec, storage: Storage, entries: list[str], plan: JobPlan | None = None) -> None:
    """OutputError unless deleting everything under the output is safe (driver/output_guard.py)."""
    refusal = overwrite_refusal(spec, storage, entries, [f.url for f in plan.files] if plan else ())
    if refusal:
        raise OutputError(refusal)


def describe_output(spec: JobSpec, plan: JobPlan) -> str:
    """What a run would do with the output (read-only); OutputError/ResumeError when it would refuse."""
    storage = Storage(spec.output.url, spec.output.storage_options)
    try:
        entries = _entries(storage)
        lease = read_lease(storage)
        old = read_manifest_with_records(storage) if entries else None
    except (StorageError, OSError) as exc:
        raise OutputError(f"output.url {spec.output.url!r}: cannot access: {exc}") from None
    if lease is not None and not is_expired(lease):
        raise OutputError(f"output {spec.output.url} is in use by {describe_holder(lease)}")
    if spec.output.mode == "overwrite":
        check_overwrite(spec, storage, entries, plan)  # also when empty: the input containment
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
    old = read_manifest_with_records(storage)
    if old is None:
        raise _foreign_output(spec)
    check_resumable(old, spec, plan.shards)
    present = list_parts(storage)
    manifest = resume_manifest(old, spec, set(present))
    storage.delete_many(orphan_parts(manifest, present))
    return manifest


def _foreign_output(spec: JobSpec) -> OutputError:
    return OutputError(f"output.url {spec.output.url!r} has files but no {MANIFEST}: not a jobrunner "
                       "output; use output.mode=overwrite or another output.url")
