"""Run a pipeline (`stages:`): every stage a job of its own under the job's output, all at once, streaming.

One Ray session holds them all. Each stage's job loop (driver/job.py) runs on a thread of its own, with its
own workers and its own output lease: stage 1 plans the job's input as any job does; each later stage takes
its shards from a feed over the previous stage's committed shards (driver/stage_feed.py), so it starts on
the first shard committed upstream. A follower writes the final rows (`<output>/parts/`) from the last stage's
committed shards the same way. When a stage's run ends, its feed is told (and whether it finished); the
downstream stage drains what was committed and ends. Ctrl-C stops every stage through its stop event (each
ends as an interrupted run does: what it committed stays). `_pipeline.json` names the stages and their funnel.
"""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from jobrunner.driver.job import run_job
from jobrunner.driver.manifest import now_iso
from jobrunner.driver.output import OutputError
from jobrunner.driver.pipeline_view import FunnelTally, PipelineView, stage_outcomes
from jobrunner.driver.plan import with_absolute_output
from jobrunner.driver.result import JobResult
from jobrunner.driver.rows import job_output_schema
from jobrunner.driver.session import ray_session
from jobrunner.driver.stage_feed import StageFeed, StageHooks
from jobrunner.io.layout import PARTS_DIR, REPORT_DIR, SUCCESS, TEMP_DIR
from jobrunner.io.manifest import clear_success, mark_success
from jobrunner.io.reader import InputError
from jobrunner.io.stage_input import PIPELINE_FILE, final_key, pipeline_funnel
from jobrunner.io.storage import Storage
from jobrunner.io.text_input import list_input
from jobrunner.pipeline.expr import parse_filter
from jobrunner.pipeline.handoff import CONVERSATION, METRIC_COLUMNS, Handoff, NextRequest, parse_output_column
from jobrunner.pipeline.stage_specs import STAGES_DIR
from jobrunner.pipeline.template import parse_template
from jobrunner.redaction import redacting_logger, remember_secrets
from jobrunner.spec import JobSpec, StageSpec

log = redacting_logger(__name__)
JOIN_POLL_S = 0.2


@dataclass
class PipelineResult:
    """Each stage's result (None: it stopped with `errors[name]`), and the funnel per stage."""

    output_url: str
    stage_names: list[str]
    results: dict[str, JobResult | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    funnel: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors and all(r is not None and r.ok for r in self.results.values())

    def summary(self, failures: bool = True) -> str:
        """One line per stage (its job's summary) and the funnel."""
        lines = []
        for name in self.stage_names:
            result = self.results.get(name)
            text = result.summary(failures) if result is not None else f"stopped: {self.errors.get(name)}"
            lines.append(f"stage {name}: {text}")
        lines.extend(funnel_lines(self.funnel))
        return "\n".join(lines)

    def failure_message(self) -> str:
        for name in self.stage_names:
            result = self.results.get(name)
            if name in self.errors:
                return f"stage {name}: {self.errors[name]}"
            if result is not None and not result.ok:
                return f"stage {name}: {result.failure_message()}"
        return "the pipeline did not finish"


def funnel_lines(funnel: list[dict[str, Any]]) -> list[str]:
    """`funnel: generate 64 in -> 60 kept (3 dropped, 1 error rows) | judge ...`"""
    if not funnel:
        return []
    parts = [f"{f['stage']} {f['rows_in']} in -> {f['kept']} kept ({f['dropped']} dropped by filter"
             + (f", {f['filter_error']} filter errors" if f["filter_error"] else "") + f", {f['error']} error row(s))"
             for f in funnel]
    return ["funnel: " + " | ".join(parts)]


def handoffs(spec: JobSpec, stage_specs: list[JobSpec]) -> list[Handoff]:
    """Per stage, how its rows are handed on: to the next stage's input, or (the last) to the final output."""
    out = []
    for i, stage in enumerate(spec.stages):
        nxt = _next_request(spec.stages[i + 1], stage_specs[i + 1]) if i + 1 < len(spec.stages) else None
        first = stage_specs[0].input
        out.append(Handoff(stage=stage.name, next=nxt,
                           output_columns={k: parse_output_column(k, v) for k, v in stage.output_columns.items()},
                           filter=None if stage.filter is None else parse_filter(stage.filter),
                           base_prompt_column=first.prompt_column if i == 0 else None,
                           base_messages_column=first.messages_column if i == 0 else None))
    return out


def _next_request(stage: StageSpec, stage_spec: JobSpec) -> NextRequest:
    inp = stage.input
    names = frozenset(job_output_schema(stage_spec).names)
    messages = tuple((m["role"], parse_template(m["content"])) for m in inp.messages or [])
    return NextRequest(prompt=None if inp.prompt is None else parse_template(inp.prompt), messages=messages,
                       completion=None if inp.completion is None else parse_template(inp.completion),
                       output_names=names, stage=stage.name)


def run_pipeline(spec: JobSpec, address: str | None = None, show_progress: bool = True,
                 started_s: float | None = None) -> PipelineResult:
    """Run every stage of `spec` to the end (the feed and final follower streaming between them)."""
    remember_secrets(spec.secret_values())
    spec = with_absolute_output(spec)
    stage_specs = spec.stage_specs()
    rules = handoffs(spec, stage_specs)
    first = stage_specs[0].input
    files = list_input(first.url, first.storage_options, first.format)
    problems = column_problems(spec, stage_specs, {c for f in files for c in f.column_types})
    if problems:  # a column no row can hold: every row would be an error row (validate says the same)
        raise InputError(f"{len(problems)} template / filter column(s) never exist upstream: " + "; ".join(problems))
    root = Storage(spec.output.url, spec.output.storage_options)
    _prepare_root(spec, root, stage_specs)
    stop = threading.Event()
    feeds = [None] + [StageFeed(_storage(stage_specs[i - 1]), rules[i - 1], spec.rows_per_shard)
                      for i in range(1, len(stage_specs))]
    final = StageFeed(_storage(stage_specs[-1]), rules[-1], spec.rows_per_shard, key_of=final_key)
    final.attach(root, None)
    result = PipelineResult(spec.output.url, [s.name for s in spec.stages])
    hooks = [StageHooks(feeds[i], stop) for i in range(len(stage_specs))]
    below = [*feeds[1:], final]  # the feed that takes each stage's committed shards
    names = [s.name for s in spec.stages]
    view = PipelineView(names, hooks, below, FunnelTally(root, names), enabled=show_progress, started_s=started_s)
    with ray_session(_sized(spec, stage_specs), address):
        threads = [_Thread(_run_stage, f"stage-{s.name}", stage_specs[i], s.name, hooks[i], address, started_s,
                           result, below[i]) for i, s in enumerate(spec.stages)]
        threads.append(_Thread(_follow, "final", final, stop))
        for thread in threads:
            thread.start()
        _join(threads, stop, view, result)
    result.funnel = pipeline_funnel(root, [s.name for s in spec.stages])
    _write_record(root, spec, stage_specs, result)
    root.delete(TEMP_DIR, recursive=True)
    if result.ok:
        mark_success(root)
    return result


def _run_stage(stage_spec: JobSpec, name: str, hooks: StageHooks, address: str | None, started_s: float | None,
               result: PipelineResult, downstream: StageFeed) -> None:
    ok = False
    try:
        job = run_job(stage_spec, address, show_progress=False, started_s=started_s, stage=hooks)
        result.results[name] = job
        ok = job.ok
    except BaseException as exc:  # noqa: BLE001 - the stage's error is the pipeline's, reported by stage
        result.results[name] = None
        result.errors[name] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, KeyboardInterrupt) else \
            "interrupted"
        if not isinstance(exc, KeyboardInterrupt):  # an interrupt: the console view's end line says it
            log.error("stage %s stopped: %s", name, result.errors[name])
    finally:
        downstream.upstream_ended(ok)


def _follow(final: StageFeed, stop: threading.Event) -> None:
    """Write the final rows from the last stage's committed shards until that stage's run has ended."""
    while final.is_open and not stop.is_set():
        final.poll()
        time.sleep(final.poll_s / 2)


class _Thread(threading.Thread):
    """A daemon thread whose end is an event: Thread.is_alive() is not to be trusted after a Ctrl-C landed in a
    join() of it (Python 3.11 then marks a running thread stopped), so the pipeline waits on `ended` instead."""

    def __init__(self, target: Any, name: str, *args: Any) -> None:
        super().__init__(name=name, daemon=True)
        self.body, self.body_args, self.ended = target, args, threading.Event()

    def run(self) -> None:
        try:
            self.body(*self.body_args)
        finally:
            self.ended.set()


def _join(threads: list[_Thread], stop: threading.Event, view: PipelineView, result: PipelineResult) -> None:
    """Wait for every thread, the console view printing as stages start and end; Ctrl-C sets `stop` (each stage
    ends as an interrupted run) and is raised after."""
    interrupted = False
    while not all(t.ended.is_set() for t in threads):
        try:
            time.sleep(JOIN_POLL_S / 2)
            view.poll(stage_outcomes(result.results, result.errors))
        except KeyboardInterrupt:
            stop.set()
            interrupted = True
    view.poll(stage_outcomes(result.results, result.errors), final=True)
    if interrupted:
        raise KeyboardInterrupt


def _storage(stage_spec: JobSpec) -> Storage:
    return Storage(stage_spec.output.url, stage_spec.output.storage_options)


def _sized(spec: JobSpec, stage_specs: list[JobSpec]) -> JobSpec:
    """The spec a local Ray is sized by: every stage's workers at once."""
    cpus = sum(s.cluster.num_workers * s.cluster.num_cpus_per_worker for s in stage_specs)
    cluster = spec.cluster.model_copy(update={"num_workers": max(1, math.ceil(cpus)), "num_cpus_per_worker": 1.0})
    return spec.model_copy(update={"cluster": cluster})


def _prepare_root(spec: JobSpec, root: Storage, stage_specs: list[JobSpec]) -> None:
    """output.mode error: refuse an output that exists; overwrite: drop the final rows (each stage overwrites
    its own output); always: the pipeline is running (no _SUCCESS), and `_pipeline.json` names its stages."""
    entries = [e.rsplit("/", 1)[-1] for e in root.listdir("")]
    if spec.output.mode == "error" and entries:
        raise OutputError(f"output.url {spec.output.url!r} already exists (output.mode=error)")
    foreign = [e for e in entries if e not in (PARTS_DIR, STAGES_DIR, PIPELINE_FILE, SUCCESS, REPORT_DIR, TEMP_DIR)]
    if foreign:
        raise OutputError(f"output.url {spec.output.url!r} holds {', '.join(sorted(foreign)[:5])}: not a "
                          "pipeline's output; use another output.url")
    if spec.output.mode == "overwrite":
        root.delete(PARTS_DIR, recursive=True)
    clear_success(root)
    _write_record(root, spec, stage_specs, None)


def _write_record(root: Storage, spec: JobSpec, stage_specs: list[JobSpec], result: PipelineResult | None) -> None:
    record: dict[str, Any] = {"name": spec.name, "updated_at": now_iso(), "stages": [
        {"name": stage.name, "task": s.task, "url": f"{STAGES_DIR}/{stage.name}", "model": s.model.source,
         "filter": stage.filter, "output_columns": stage.output_columns}
        for stage, s in zip(spec.stages, stage_specs, strict=True)]}
    if result is not None:
        record.update(finished=result.ok, funnel=result.funnel, errors=result.errors)
    root.write_atomic(PIPELINE_FILE, json.dumps(record, indent=1).encode())


def column_problems(spec: JobSpec, stage_specs: list[JobSpec], input_columns: set[str]) -> list[str]:
    """Template and filter columns that no row of the stage before can ever hold (the schema: the job's input
    columns, each stage's output columns, output_columns, the carried columns and their renames), naming the
    stage, the field and the column."""
    rules = handoffs(spec, stage_specs)
    problems: list[str] = []
    available = set(input_columns) | set(job_output_schema(stage_specs[0]).names)
    for i, stage in enumerate(spec.stages):
        if i:
            problems += _missing(i, stage, spec.stages[i - 1].name, _template_fields(stage), available)
            carried = {rules[i - 1].carried_name(c) for c in available if c not in METRIC_COLUMNS and c != "id"}
            available = carried | {"id", CONVERSATION} | set(job_output_schema(stage_specs[i]).names)
        if stage.output_columns:
            available |= set(stage.output_columns) | {"json_valid"}
        if stage.filter is not None:
            columns = parse_filter(stage.filter).columns
            problems += _missing(i, stage, stage.name, {"filter": columns}, available, own=True)
    return problems


def _template_fields(stage: StageSpec) -> dict[str, tuple[str, ...]]:
    inp = stage.input
    fields = {f"input.messages[{j}].content": parse_template(m["content"]).columns for j, m in
              enumerate(inp.messages or [])}
    for name in ("prompt", "completion"):
        if getattr(inp, name) is not None:
            fields[f"input.{name}"] = parse_template(getattr(inp, name)).columns
    return fields


def _missing(index: int, stage: StageSpec, source: str, fields: dict[str, tuple[str, ...]], available: set[str],
             own: bool = False) -> list[str]:
    whose = f"stage {source}'s own rows" if own else f"the rows of stage {source}"
    shown = ", ".join(sorted(c for c in available if c not in METRIC_COLUMNS)[:40])
    return [f"stages[{index}] ({stage.name}): {field}: column {column!r} never exists in {whose} "
            f"(they have: {shown})" for field, columns in fields.items() for column in columns
            if column not in available]
