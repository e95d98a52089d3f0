"""The output location: checked, leased to this run, then prepared per `output.mode`.

One run per output: the lease (`io/lease.py`) is taken before anything under the output changes; a lease
held by a run that is provably dead (its pid gone on this host, or its Ray job ended: driver/ray_holder.py)
is taken over at once, any other is watched (with a countdown on stderr)
until it expires or shows its holder alive. Everything the run writes afterwards goes through a
`FencedStorage`. `overwrite` deletes only a prefix that is empty or holds a jobrunner output (entries
`parts/`, `_*`, report files), never a bucket or filesystem root, never a prefix that is or contains the
input. An output whose earlier runs committed nothing is replaced whatever changed; one with committed
shards is resumed only with the same settings (driver/resume_check.py).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobrunner.driver.incremental import INCREMENTAL_KEY, check_settings, kept_shards, plan_incremental
from jobrunner.driver.manifest import ResumeError, continued_header, new_manifest, orphan_parts, resume_manifest
from jobrunner.driver.output_guard import containment_refusal, overwrite_refusal
from jobrunner.driver.ray_holder import holder_is_dead, lease_extra
from jobrunner.driver.resume_check import check_resume, num_committed
from jobrunner.driver.resume_checks import INPUTS_KEY, check_pinned_inputs, input_pins, trusted_parts
from jobrunner.driver.shards import ShardTable
from jobrunner.io.done_ids import DoneIdsError
from jobrunner.io.layout import COMMITS_DIR, LEASE, LEASE_GENERATION, MANIFEST, PARTS_DIR, TEMP_DIR
from jobrunner.io.lease import (
    FencedStorage,
    Lease,
    LeaseHeld,
    acquire_lease,
    describe_holder,
    is_free,
    read_lease,
)
from jobrunner.io.manifest import clear_success, read_manifest_table
from jobrunner.io.parts import list_parts
from jobrunner.io.shard_file import COMMITTED, ShardColumns
from jobrunner.io.storage import Storage, StorageError
from jobrunner.redaction import redact_text, say
from jobrunner.spec import JobSpec

if TYPE_CHECKING:
    from jobrunner.driver.plan import JobPlan


class OutputError(ValueError):
    """The output location cannot be used as asked (exists in error mode, unreachable, foreign files)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact_text(str(message)))


@dataclass(frozen=True)
class PreviousOutput:
    """What earlier runs left at the output, read once before planning (`read_previous_output`): planning
    needs the old manifest's header (driver/prefix_plan.py) and opening the output its shard table."""

    entries: list[str]  # top-level names, without the lease's own files
    holder: dict[str, Any] | None  # the lease object (read before the manifest), None when there is none
    table: tuple[dict[str, Any], ShardColumns] | None  # the manifest and its shards (resume mode only)

    @property
    def header(self) -> dict[str, Any] | None:
        """The old manifest without its shards, or None (no manifest, or a mode that does not resume)."""
        return self.table[0] if self.table else None

    def is_current(self, lease: Lease) -> bool:
        """Whether nobody can have written the output between this read and `lease`'s claim: the lease was
        free then and its generation moved by exactly one (this run's claim)."""
        generation = (self.holder or {}).get("generation")
        before = generation if isinstance(generation, int) else 0
        return is_free(self.holder) and lease.taken_over is None and lease.generation == before + 1


def read_previous_output(spec: JobSpec) -> PreviousOutput:
    """The output's entries, lease and (in resume mode) manifest, read-only; OutputError when unreachable, or
    when the output and the input overlap (before planning lists an input that holds earlier output).

    The lease is read before the manifest: a run that took the lease after that read moves its generation,
    and `PreviousOutput.is_current` then sends `open_output` back to the manifest."""
    storage = Storage(spec.output.url, spec.output.storage_options)
    refusal = containment_refusal(spec, storage)  # on the URLs; the planned files are checked in open_output
    if refusal:
        raise OutputError(refusal)
    try:
        entries = _entries(storage)
        holder = read_lease(storage)
        table = _read_table(spec, storage, entries)
    except (StorageError, OSError) as exc:
        raise OutputError(f"output.url {spec.output.url!r}: cannot access: {exc}") from None
    return PreviousOutput(entries, holder, table)


def _read_table(spec: JobSpec, storage: Storage, entries: list[str]) -> tuple[dict[str, Any], ShardColumns] | None:
    # overwrite reads no table (an unreadable manifest is its refusal, driver/output_guard.py); error no output
    return read_manifest_table(storage) if entries and spec.output.mode in ("resume", "incremental") else None


def open_output(spec: JobSpec, plan: JobPlan,
                previous: PreviousOutput) -> tuple[Storage, dict[str, Any], Lease]:
    """Check the output, take its lease, prepare it per output.mode; the manifest to continue from.

    previous: the output as read before planning (`read_previous_output`); its manifest is used when nobody
    held the lease since, else read again."""
    storage = Storage(spec.output.url, spec.output.storage_options)
    try:
        # before the probe write and any wait for the lease: nothing is written where this mode may not write
        _check_mode(spec, storage, previous.entries, plan)
        storage.check_writable()
    except (StorageError, OSError) as exc:
        raise OutputError(f"output.url {spec.output.url!r}: cannot write there: {exc}") from None
    try:
        lease = acquire_lease(storage, uuid.uuid4().hex[:12], spec.output.lease_ttl_s, spec.name,
                              is_dead=holder_is_dead, on_wait=CountdownPrinter(storage.display()),
                              extra=lease_extra())
    except LeaseHeld as exc:
        raise OutputError(str(exc)) from None
    fenced = FencedStorage(storage, lease)
    try:
        if not previous.is_current(lease):  # another run held the output meanwhile: it may have written more
            previous = read_previous_output(spec)
        _check_mode(spec, storage, previous.entries, plan)
        manifest = _prepare(spec, plan, fenced, previous, lease)
    except BaseException:
        lease.release()
        raise
    _say_resuming(storage.display(), plan, lease)
    return fenced, manifest, lease


def _say_resuming(url: str, plan: JobPlan, lease: Lease) -> None:
    """One stderr line when this run continues earlier work or took the lease from a run that is gone."""
    if plan.incremental is not None:
        taken = f"; took over the lease: {lease.taken_over}" if lease.taken_over else ""
        say(f"output {url}: {plan.incremental.line()}{taken}")
        return
    total = len(plan.shards)
    done = int((plan.shards.columns.status == COMMITTED).sum())
    if not done and lease.taken_over is None:
        return
    rest = "running the rest" if done < total else "nothing left to run"
    if plan.stage:  # a pipeline stage: the rest comes from the previous stage (driver/stage_feed.py)
        rest = "the rest comes from the previous stage's committed shards"
    line = f"resuming output {url}: {done} of {total} shards already committed, {rest}"
    if not done:
        line = f"output {url}: no shard committed yet" + ("" if plan.stage else f", running all {total}")
    if lease.taken_over:
        line += f"; took over the lease: {lease.taken_over}"
    say(line)


def _check_mode(spec: JobSpec, storage: Storage, entries: list[str], plan: JobPlan) -> None:
    """OutputError when this output.mode may not write here: never where the input is (driver/output_guard.py),
    overwrite only over an empty folder or this job's output, error only into an empty one."""
    if spec.output.mode == "overwrite":
        check_overwrite(spec, storage, entries, plan)
    else:
        refusal = containment_refusal(spec, storage, [f.url for f in plan.files])
        if refusal:
            raise OutputError(refusal)
    if entries and spec.output.mode == "error":
        raise OutputError(f"output.url {spec.output.url!r} already exists (output.mode=error)")


def _entries(storage: Storage) -> list[str]:
    """Top-level names under the output, without the lease's own files (`_lease.json`, its `.v<N>` versions)."""
    return [e for e in storage.listdir("") if e != TEMP_DIR and not e.startswith(LEASE)]


class CountdownPrinter:
    """Prints, at most every PERIOD_S, who holds the output and how long until this run takes it over."""

    PERIOD_S = 5.0

    def __init__(self, url: str) -> None:  # noqa: D107
        self.url, self.next_at = url, 0.0

    def __call__(self, holder: dict[str, Any], left_s: float) -> None:  # noqa: D102
        if time.monotonic() < self.next_at:
            return
        self.next_at = time.monotonic() + self.PERIOD_S
        say(f"output {self.url} is leased by {describe_holder(holder)}; no heartbeat seen yet: "
            f"taking it over in {left_s:.0f} s unless it renews (then this run stops)")


def _prepare(spec: JobSpec, plan: JobPlan, storage: Storage, previous: PreviousOutput,
             lease: Lease) -> dict[str, Any]:
    if previous.entries and spec.output.mode == "overwrite":
        for entry in previous.entries:
            storage.delete(entry, recursive=True)
        previous = PreviousOutput([], None, None)
    manifest = _resume_or_new(spec, plan, storage, previous, lease)
    manifest[LEASE_GENERATION] = lease.generation  # the fencing epoch, in the start-up compaction
    clear_success(storage)
    storage.delete(TEMP_DIR, recursive=True)
    return manifest


def check_overwrite(spec: JobSpec, storage: Storage, entries: list[str], plan: JobPlan | None = None) -> None:
    """OutputError unless deleting everything under the output is safe (driver/output_guard.py)."""
    refusal = overwrite_refusal(spec, storage, entries, [f.url for f in plan.files] if plan else ())
    if refusal:
        raise OutputError(refusal)


def describe_output(spec: JobSpec, plan: JobPlan, previous: PreviousOutput) -> str:
    """What a run would do with the output (read-only); OutputError/ResumeError when it would refuse."""
    storage = Storage(spec.output.url, spec.output.storage_options)
    holder = previous.holder
    held = ""
    if not is_free(holder) and not holder_is_dead(holder):
        held = (f"leased by {describe_holder(holder)}: run waits up to {holder.get('ttl_s')} s for the lease to "
                "expire (and stops if it is renewed); ")
    _check_mode(spec, storage, previous.entries, plan)  # also when empty: the input containment
    return held + _describe_state(spec, plan, previous.entries, previous.table)


def _describe_state(spec: JobSpec, plan: JobPlan, entries: list[str],
                    old: tuple[dict[str, Any], ShardColumns] | None) -> str:
    if not entries:
        if spec.output.mode == "incremental":
            return "output is empty: a new job; " + _describe_incremental(spec, plan, storage_of(spec), None, None)
        return "output is empty: a new job"
    if spec.output.mode == "error":
        raise OutputError(f"output.url {spec.output.url!r} already exists (output.mode=error)")
    if spec.output.mode == "overwrite":
        return "output exists and will be deleted (output.mode=overwrite)"
    if old is None:
        raise _foreign_output(spec)
    header, old_shards = old
    if spec.output.mode == "incremental":
        return _describe_incremental(spec, plan, storage_of(spec), header, old_shards)
    if not num_committed(old_shards):
        return "output holds runs that committed nothing: a new job replaces them"
    _check_resumable(header, old_shards, spec, plan)
    done = num_committed(old_shards)
    return f"output exists: {done}/{len(plan.shards)} shards committed; resume runs the rest"


def storage_of(spec: JobSpec) -> Storage:
    """The output's storage (unfenced: for reading)."""
    return Storage(spec.output.url, spec.output.storage_options)


def _describe_incremental(spec: JobSpec, plan: JobPlan, storage: Storage, header: dict[str, Any] | None,
                          old_shards: ShardColumns | None) -> str:
    """What an incremental run would take (read-only: the same plan, nothing deleted)."""
    kept = None
    if old_shards is not None and num_committed(old_shards):
        check_settings(header or {}, old_shards, spec)
        kept = kept_shards(old_shards, trusted_parts(storage, old_shards))
    _plan_incremental(spec, plan, storage, kept, 0)
    done = len(kept) if kept is not None else 0
    return f"{done} shard(s) committed by earlier runs; {plan.incremental.line()}"


def _resume_or_new(spec: JobSpec, plan: JobPlan, storage: Storage, previous: PreviousOutput,
                   lease: Lease) -> dict[str, Any]:
    manifest = _manifest_to_continue(spec, plan, storage, previous, lease)
    manifest[INPUTS_KEY] = input_pins(plan.files)  # this run's inputs: the next resume checks against them
    return manifest


def _manifest_to_continue(spec: JobSpec, plan: JobPlan, storage: Storage, previous: PreviousOutput,
                          lease: Lease) -> dict[str, Any]:
    if spec.output.mode == "incremental":
        return _continue_incremental(spec, plan, storage, previous, lease)
    if plan.stage:
        return _continue_stage(spec, plan, storage, previous, lease)
    if not previous.entries:
        return new_manifest(spec, plan.shards)
    header, old_shards = _previous_table(spec, previous, lease)
    if not num_committed(old_shards):
        return _replace(spec, plan, storage, header)
    _check_resumable(header, old_shards, spec, plan)
    present = list_parts(storage)
    trusted = sorted(trusted_parts(storage, old_shards))  # parts checked (size, rows), not just listed
    manifest = resume_manifest(header, spec, old_shards, plan.shards, trusted)  # plan.shards takes the state
    storage.delete_many(orphan_parts(plan.shards, present))
    return manifest


def _continue_incremental(spec: JobSpec, plan: JobPlan, storage: Storage, previous: PreviousOutput,
                          lease: Lease) -> dict[str, Any]:
    """An incremental run (driver/incremental.py): the committed shards that check out stay, parts no kept
    shard names go, and the rows whose ids are not done become this run's shards."""
    kept, manifest = None, None
    if previous.entries:
        header, old_shards = _previous_table(spec, previous, lease)
        if num_committed(old_shards):
            check_settings(header, old_shards, spec)
            kept = kept_shards(old_shards, trusted_parts(storage, old_shards))
            manifest = continued_header(header, spec)
        else:
            manifest = _replace(spec, plan, storage, header)
    _plan_incremental(spec, plan, storage, kept, lease.generation)
    storage.delete_many(orphan_parts(plan.shards, list_parts(storage)))
    manifest = manifest if manifest is not None else new_manifest(spec, plan.shards)
    manifest[INCREMENTAL_KEY] = plan.incremental.describe()
    return manifest


def _continue_stage(spec: JobSpec, plan: JobPlan, storage: Storage, previous: PreviousOutput,
                    lease: Lease) -> dict[str, Any]:
    """A pipeline stage after the first (driver/stage_feed.py): its committed shards whose parts check out are
    kept by id, as an incremental run keeps its own; the rest are forgotten (their parts deleted), and its feed
    hands them out again under the same ids, with the previous stage's shards committed since."""
    if not previous.entries:
        return new_manifest(spec, plan.shards)
    header, old_shards = _previous_table(spec, previous, lease)
    if not num_committed(old_shards):
        return _replace(spec, plan, storage, header)
    check_settings(header, old_shards, spec)
    kept = kept_shards(old_shards, trusted_parts(storage, old_shards))
    plan.shards = ShardTable(kept, [url.rsplit("/", 1)[-1].removesuffix(".parquet") for url in kept.file.values],
                             [None] * len(kept.file.values))
    storage.delete_many(orphan_parts(plan.shards, list_parts(storage)))
    return continued_header(header, spec)


def _plan_incremental(spec: JobSpec, plan: JobPlan, storage: Storage, kept: ShardColumns | None,
                      generation: int) -> None:
    try:
        plan.shards, plan.prefix, plan.incremental = plan_incremental(spec, plan.files, storage, kept, generation)
    except DoneIdsError as exc:
        raise OutputError(str(exc)) from None


def _check_resumable(header: dict[str, Any], old_shards: ShardColumns, spec: JobSpec, plan: JobPlan) -> None:
    """ResumeError when the committed shards were made from other input files or with other settings. A changed
    file is named first (it also changes the shard plan); a changed input.limit is named as a setting (the
    files then look changed too, cut to another number of rows). An output that incremental runs wrote is
    continued by another incremental run, not a resume (its shards were cut from the rows not done)."""
    if INCREMENTAL_KEY in header:
        raise ResumeError(f"output.url {spec.output.url!r} was written by incremental runs (output.mode="
                          "incremental): their shards were cut from the rows not done then, so a resume cannot "
                          "plan them again; continue it with output.mode=incremental (it skips the ids already "
                          "committed and runs the rest, each id once), or start over with output.mode=overwrite")
    old_limit = ((header.get("spec") or {}).get("input") or {}).get("limit")
    if old_limit == spec.input.limit:
        check_pinned_inputs(header, old_shards, plan.files)
    check_resume(header, old_shards, spec, plan.shards)
    check_pinned_inputs(header, old_shards, plan.files)


def _previous_table(spec: JobSpec, previous: PreviousOutput, lease: Lease) -> tuple[dict[str, Any], Any]:
    """The earlier run's manifest header and shard table (an output without one is refused); the lease's epoch
    moved past the recorded one, so epochs keep increasing even when the lease object was deleted by hand."""
    if previous.table is None:
        raise _foreign_output(spec)
    header, old_shards = previous.table
    old_generation = header.get(LEASE_GENERATION)
    if isinstance(old_generation, int) and old_generation >= lease.generation:
        lease.advance_to(old_generation + 1)
    return header, old_shards


def _foreign_output(spec: JobSpec) -> OutputError:
    return OutputError(f"output.url {spec.output.url!r} has files but no {MANIFEST}: not a jobrunner "
                       "output; use output.mode=overwrite or another output.url")


def _replace(spec: JobSpec, plan: JobPlan, storage: Storage, old: dict[str, Any]) -> dict[str, Any]:
    """A new manifest over an output whose runs committed nothing (a failed first run, whatever it was run
    with): its leftovers go, its run count and history stay, with the workers those runs paid for."""
    storage.delete(PARTS_DIR, recursive=True)
    storage.delete(COMMITS_DIR, recursive=True)
    manifest = new_manifest(spec, plan.shards)
    manifest.update(run_count=int(old.get("run_count") or 0), runs=list(old.get("runs") or []),
                    workers=dict(old.get("workers") or {}))
    return manifest
