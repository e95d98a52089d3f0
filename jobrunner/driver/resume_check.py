"""Whether an existing output can be resumed with a spec, and if not, exactly what differs.

Only an output with committed shards is protected: its rows were made with the old settings, so a resume
with other model/sampling settings, another execution mode (``engine.deterministic``) or another shard plan
would mix two jobs in one output. The refusal lists every differing field with its old and new value (from
the redacted specs: no secret is shown) and the two ways on. An output whose runs committed nothing has
nothing to protect and is simply replaced (driver/output.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jobrunner.driver.manifest import RESUME_INPUT_KEYS, RESUME_SECTIONS, ResumeError
from jobrunner.driver.row_seeds import seed_rule
from jobrunner.driver.shards import ShardTable
from jobrunner.io.shard_file import COMMITTED, ShardColumns
from jobrunner.spec import JobSpec

MAX_SHOWN = 20  # differing fields listed in a message
# engine settings that change which tokens a row gets: batch-invariant (deterministic) rows differ in bits from
# default-mode rows, so one output must not mix the two (its promise is byte-identical datasets on rerun); and
# one output is written by one engine (jobrunner or vllm), so its report describes that engine
RESUME_ENGINE_DEFAULTS = {"deterministic": False, "backend": "jobrunner"}
# what kind of rows the output holds (text, embeddings, scores) and how embeddings were pooled; absent: a spec
# written before embed / score jobs, which generated
RESUME_TASK_DEFAULTS = {"task": "generate", "embed.pooling": "auto", "embed.normalize": "auto"}
# engine.backend openai: the model the endpoint serves makes the rows (its URL, budgets and key may change)
RESUME_ENDPOINT_KEYS = {"engine.endpoint.model": None}
# how referenced images enter fingerprints (io/image_prints.py): another rule makes every such row "changed"
RESUME_IMAGE_DEFAULTS = {"input.image_fingerprint": "content"}


def num_committed(old_shards: ShardColumns) -> int:
    """Committed shards in a manifest's shard table (commit records folded in)."""
    return int((old_shards.status == COMMITTED).sum())


def flatten(value: Any, prefix: str) -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"<prefix>.a.b": 1}; lists and scalars are leaves."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    out: dict[str, Any] = {}
    for key in sorted(value):
        out.update(flatten(value[key], f"{prefix}.{key}"))
    return out


def spec_differences(old_spec: dict[str, Any], new_spec: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, old value, new value) for every resume-relevant field that differs between two redacted specs."""
    old_flat: dict[str, Any] = {}
    new_flat: dict[str, Any] = {}
    for section in RESUME_SECTIONS:
        old_flat.update(flatten(old_spec.get(section) or {}, section))
        new_flat.update(flatten(new_spec.get(section) or {}, section))
    for key in RESUME_INPUT_KEYS:
        old_flat[f"input.{key}"] = (old_spec.get("input") or {}).get(key)
        new_flat[f"input.{key}"] = (new_spec.get("input") or {}).get(key)
    for key, default in RESUME_ENGINE_DEFAULTS.items():  # absent: a spec written before the setting existed
        old_flat[f"engine.{key}"] = (old_spec.get("engine") or {}).get(key, default)
        new_flat[f"engine.{key}"] = (new_spec.get("engine") or {}).get(key, default)
    for key, default in {**RESUME_TASK_DEFAULTS, **RESUME_ENDPOINT_KEYS, **RESUME_IMAGE_DEFAULTS}.items():
        old_flat[key], new_flat[key] = _dotted(old_spec, key, default), _dotted(new_spec, key, default)
    # how rows were seeded (driver/row_seeds.py): a spec written before seed_per_row seeded every row alike
    old_flat["sampling.seed_per_row"] = seed_rule(old_spec.get("sampling") or {})
    new_flat["sampling.seed_per_row"] = seed_rule(new_spec.get("sampling") or {})
    missing = object()
    fields = sorted(set(old_flat) | set(new_flat))
    return [(f, old_flat.get(f, missing), new_flat.get(f, missing)) for f in fields
            if old_flat.get(f, missing) != new_flat.get(f, missing)
            and not _both_default(old_flat.get(f, missing), new_flat.get(f, missing), missing)]


def _dotted(spec: dict[str, Any], key: str, default: Any) -> Any:
    """The value at ``a.b`` in a spec dict, or ``default`` where it is absent."""
    value: Any = spec
    for part in key.split("."):
        value = value.get(part, default) if isinstance(value, dict) else default
    return value


def _both_default(old: Any, new: Any, missing: object) -> bool:
    """A field absent on one side (a spec written by an older version) and unset on the other (None, or an
    empty mapping / list such as ``model.adapters: {}``) is no change."""
    def unset(value: Any) -> bool:
        return value is None or (isinstance(value, (dict, list)) and not value)

    return (old is missing and unset(new)) or (new is missing and unset(old))


def _why(field: str) -> str:
    """What a differing field means, where a bare old -> new would not say it."""
    if field == "engine.deterministic":
        return (" (the committed rows were made in the other execution mode: a rerun of this output must use "
                "the mode that wrote it to reproduce its bytes)")
    return ""


def _show(value: Any) -> str:
    return "(absent)" if type(value) is object else repr(value)


def plan_differences(old: dict[str, Any], old_shards: ShardColumns, spec: JobSpec, shards: ShardTable) -> list[str]:
    """Lines describing how the shard plan differs (input files or rows per shard changed)."""
    old_ids, new_ids = np.unique(old_shards.shard_id), np.unique(shards.columns.shard_id)
    if len(old_ids) == len(new_ids) and np.array_equal(old_ids, new_ids):
        return []
    gone = int((~np.isin(old_ids, new_ids)).sum())
    new = int((~np.isin(new_ids, old_ids)).sum())
    lines = [f"shards: {len(old_ids)} before, {len(new_ids)} now ({gone} no longer planned, "
             f"{new} new): the input files, the rows per shard or the prefix grouping changed"]
    old_spec, new_spec = old.get("spec") or {}, spec.redacted()
    for section, key in (("input", "rows_per_shard"), ("output", "rows_per_file"), ("input", "prefix_grouping"),
                         ("input", "prefix_chars"), ("input", "prefix_column")):
        before, now = (old_spec.get(section) or {}).get(key), new_spec[section].get(key)
        if before != now:
            lines.append(f"{section}.{key}: {before!r} -> {now!r}")
    return lines


def name_difference(old: dict[str, Any], spec: JobSpec) -> list[str]:
    """The job name, when the output was written by a job of another name (overwrite refuses that output)."""
    before = (old.get("spec") or {}).get("name")
    if before is None or before == spec.name:
        return []
    return [f"name: {before!r} -> {spec.name!r} (another job's output: overwrite refuses it, so use another "
            "output.url, or the old name to resume)"]


def check_resume(old: dict[str, Any], old_shards: ShardColumns, spec: JobSpec, shards: ShardTable) -> None:
    """ResumeError when an output with committed shards was written with other settings or another shard
    plan: the message lists each differing field (old -> new) and the two choices."""
    lines = [f"{field}: {_show(a)} -> {_show(b)}{_why(field)}"
             for field, a, b in spec_differences(old.get("spec") or {}, spec.redacted())]
    lines = name_difference(old, spec) + plan_differences(old, old_shards, spec, shards) + lines
    if not lines:
        return
    shown = lines[:MAX_SHOWN] + ([f"... and {len(lines) - MAX_SHOWN} more"] if len(lines) > MAX_SHOWN else [])
    done = num_committed(old_shards)
    raise ResumeError(
        f"output.url {spec.output.url!r} holds {done} committed shard(s) written with other settings:\n  "
        + "\n  ".join(shown)
        + f"\nEither set output.mode=overwrite to start over (deletes those {done} shard(s)), or keep the old "
        "values (revert the fields above, or write this job to a new output.url) to resume.")
