"""Where a job may write: never where the input is (any mode), and with `output.mode: overwrite` only into
an empty folder or an earlier output of the same job.

An output that is, contains or lies inside the input is refused in every mode (`containment_refusal`,
compared on resolved paths, so a symlink cannot hide it; an input folder is listed recursively, so an output
inside it would be input too). Overwrite also refuses: a bucket or filesystem root; entries jobrunner does not
write (`_archive/`, notes, a `parts/` file that is no part); a folder without a readable `_manifest.json`; the
output of another job name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jobrunner.io.layout import MANIFEST, OUTPUT_ENTRIES, PART_PREFIX, PARTS_DIR, STAGE_INPUT_DIR, part_key
from jobrunner.io.manifest import ManifestError, read_manifest
from jobrunner.io.storage import Storage, glob_matches, is_within, resolved_location, resolved_pattern
from jobrunner.redaction import redact_text, redact_url
from jobrunner.spec import JobSpec

MAX_SHOWN = 3  # names shown per kind of entry in a refusal


def overwrite_refusal(spec: JobSpec, storage: Storage, entries: list[str],
                      input_file_urls: Iterable[str] = ()) -> str | None:
    """Why overwriting this output is refused, or None when it is safe (`entries`: its top-level names,
    without the lease and temporary folder; `input_file_urls`: the planned input files)."""
    url = redact_url(spec.output.url)
    if storage.is_root():
        return (f"output.url {url!r} is a bucket or filesystem root: output.mode=overwrite would delete "
                "everything in it; use a prefix such as .../my-job")
    refusal = containment_refusal(spec, storage, input_file_urls)
    if refusal or not entries:
        return refusal
    return ownership_refusal(spec, storage, entries)


def containment_refusal(spec: JobSpec, storage: Storage, input_file_urls: Iterable[str] = ()) -> str | None:
    """Refusal when the output and the input overlap, in any output.mode, compared on resolved locations
    (symlinks followed on local disk; `file://`, relative and trailing-slash spellings of one folder equal).

    An output inside a folder input (or one that a glob input matches) would be read back as input by the
    next run; an input inside the output lies among the output's writes (a resume deletes uncommitted files
    under parts/, overwrite everything)."""
    if spec.input.url.rstrip("/") == f"{spec.output.url.rstrip('/')}/{STAGE_INPUT_DIR}":
        return None  # a pipeline stage reads its own _input/, written once by its feed (driver/stage_feed.py)
    url, input_url = redact_url(spec.output.url), redact_url(spec.input.url)
    inp = resolved_location(spec.input.url, spec.input.storage_options)
    pattern = resolved_pattern(spec.input.url, spec.input.storage_options)
    out = storage.location()
    if pattern is None and is_within(out, inp):
        return (f"output.url {url!r} is or lies inside input.url {input_url!r} (resolved: {out[1]}), which is read "
                "recursively: the job's parts would be read back as input by the next run; use an output.url "
                "outside the input")
    sample = f"{out[1]}/{part_key('0')}"
    if pattern is not None and pattern[0] == out[0] and glob_matches(pattern[1], sample):
        return (f"output.url {url!r} lies where input.url {input_url!r} matches: its parts ({redact_url(sample)}) "
                "would be read back as input by the next run; use an output.url the pattern does not match")
    if pattern is None and is_within(inp, out):
        return (f"input.url {input_url!r} lies inside output.url {url!r} (resolved: {inp[1]}): the job would write "
                "among its input (a resume deletes files under parts/ that no shard committed, "
                "output.mode=overwrite everything); use an output.url that does not hold the input")
    for file_url in input_file_urls:
        if is_within(resolved_location(file_url, spec.input.storage_options), out):
            return (f"input file {redact_url(file_url)} resolves into output.url {url!r}: the job would read its "
                    "own output (and output.mode=overwrite delete its input); use another output.url")
    return None


def ownership_refusal(spec: JobSpec, storage: Storage, entries: list[str]) -> str | None:
    """Refusal unless the output holds only what jobrunner writes and its manifest names this job."""
    url = redact_url(spec.output.url)
    kinds = storage.listdir_kinds("")
    stray_parts = _foreign_parts(storage, entries)
    kinds.update(stray_parts)
    foreign = [e for e in entries if e not in OUTPUT_ENTRIES] + list(stray_parts)
    rule = f"output.mode=overwrite only replaces an empty folder or an earlier output of job {spec.name!r}"
    if foreign:
        return (f"output.url {url!r} holds {describe_entries(foreign, kinds)} not written by jobrunner: {rule}; "
                "move them away or use another output.url")
    try:
        manifest = read_manifest(storage)
    except ManifestError as exc:
        return f"output.url {url!r}: {MANIFEST} cannot be read ({exc}): {rule}"
    if manifest is None:
        return (f"output.url {url!r} holds {describe_entries(entries, kinds)} but no {MANIFEST}: not a jobrunner "
                f"output; {rule}")
    job = manifest.get("job_name")
    if job != spec.name:
        other = f"job {redact_text(job)!r}" if isinstance(job, str) else "a job with no name"
        return (f"output.url {url!r} is the output of {other}, not of this job {spec.name!r}: {rule}; "
                "use another output.url")
    return None


def _foreign_parts(storage: Storage, entries: list[str]) -> dict[str, bool]:
    """Entries under parts/ that are not parts (`parts/<name>` -> is a folder); parts/ is listed only if present."""
    if PARTS_DIR not in entries:
        return {}
    found = storage.listdir_kinds(PARTS_DIR)
    return {f"{PARTS_DIR}/{n.rsplit('/', 1)[-1]}": is_dir for n, is_dir in found.items()
            if is_dir or not n.rsplit("/", 1)[-1].startswith(PART_PREFIX)}


def describe_entries(names: list[str], kinds: dict[str, Any]) -> str:
    """`_archive/, _raw/ and 3 files (a.csv, b.csv, notes.txt)`: folders by name, files counted."""
    folders = [f"{n}/" for n in sorted(names) if kinds.get(n)]
    files = [n for n in sorted(names) if not kinds.get(n)]
    shown = folders[:MAX_SHOWN] + ([f"{len(folders) - MAX_SHOWN} more folders"] if len(folders) > MAX_SHOWN else [])
    if files:
        more = ", ..." if len(files) > MAX_SHOWN else ""
        shown.append(f"{len(files)} file{'s' if len(files) != 1 else ''} ({', '.join(files[:MAX_SHOWN])}{more})")
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"
