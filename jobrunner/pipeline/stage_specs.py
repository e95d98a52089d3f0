"""The job spec of each stage of a pipeline, as plain dicts (spec.py validates them as JobSpecs).

Stage 1 is the job itself (its input, every input column kept) writing to `<output>/stages/<name>/`. A later
stage reads its `_input/` files (io/stage_input.py: `id`, the carried columns, the built request in
`_stage_prompt` / `_stage_messages` / `_stage_completion`) with every column kept. A stage's `model`,
`engine`, `sampling`, `embed`, `cluster` and `cost` are merged over the job's; its `task` replaces the job's.
"""

from __future__ import annotations

from typing import Any

STAGES_DIR = "stages"
MERGED_SECTIONS = ("model", "engine", "sampling", "embed", "cluster", "cost")
# output settings every stage takes from the job (the rest of `output` belongs to the final rows or to stage 1)
SHARED_OUTPUT = ("storage_options", "lease_ttl_s", "max_error_rate", "reasoning_parser", "tool_call_parser")
# job input settings that name input columns: a later stage's input has other columns
_INPUT_COLUMN_SAMPLING = ("seed_column",)


def stage_url(output_url: str, stage_name: str) -> str:
    """The output URL of one stage."""
    return f"{output_url.rstrip('/')}/{STAGES_DIR}/{stage_name}"


def stage_dicts(job: dict[str, Any], stages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One job-spec dict per stage. `job`: the job's spec as set (without `stages`); `stages`: each stage as set
    (name, task, model, engine, sampling, embed, cluster, input, ...)."""
    out_url = job["output"]["url"]
    return [_first(job, stages[0], out_url) if i == 0 else _later(job, stage, out_url)
            for i, stage in enumerate(stages)]


def _sections(job: dict[str, Any], stage: dict[str, Any], drop_sampling: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in MERGED_SECTIONS:
        base = dict(job.get(name) or {})
        if name == "sampling":
            base = {k: v for k, v in base.items() if k not in drop_sampling}
        merged = merge(base, stage.get(name) or {})
        if merged:
            out[name] = merged
    task = stage.get("task") or job.get("task")
    if task:
        out["task"] = task
    return out


def _first(job: dict[str, Any], stage: dict[str, Any], out_url: str) -> dict[str, Any]:
    spec = {k: v for k, v in job.items() if k not in MERGED_SECTIONS and k != "task"}
    spec.update(_sections(job, stage))
    spec["name"] = f"{job['name']}.{stage['name']}"
    spec["output"] = {**job["output"], "url": stage_url(out_url, stage["name"]), "keep_columns": "*"}
    return spec


def _later(job: dict[str, Any], stage: dict[str, Any], out_url: str) -> dict[str, Any]:
    url = stage_url(out_url, stage["name"])
    output = job["output"]
    stage_input = stage.get("input") or {}
    columns = {"messages_column": "_stage_messages"} if stage_input.get("messages") else \
        {"prompt_column": "_stage_prompt"}
    if stage_input.get("completion"):
        columns["completion_column"] = "_stage_completion"
    spec: dict[str, Any] = {
        "name": f"{job['name']}.{stage['name']}",
        "input": {"url": f"{url}/_input/", "format": "parquet", "id_column": "id", "prefix_grouping": "off",
                  "storage_options": dict(output.get("storage_options") or {}), **columns},
        "output": {"url": url, "mode": "overwrite" if output.get("mode") == "overwrite" else "resume",
                   "keep_columns": "*", **{k: output[k] for k in SHARED_OUTPUT if k in output}},
    }
    spec.update(_sections(job, stage, drop_sampling=_INPUT_COLUMN_SAMPLING))
    return spec


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `update` into a copy of `base`."""
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
