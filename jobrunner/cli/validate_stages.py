"""`jobrunner validate` of a pipeline (`stages:`): each later stage's model, and every template and filter column
checked against the columns the stage before can hold (driver/pipeline.column_problems)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def stage_lines(spec: Any, plan: Any, check_model: Callable[[Any], str]) -> tuple[list[str], str | None]:
    """Lines describing each stage, and a refusal (the column problems) or None. `plan`: the first stage's."""
    from jobrunner.driver.pipeline import column_problems

    stage_specs = spec.stage_specs()
    input_columns = {c for f in plan.files for c in f.column_types}
    lines = [f"pipeline: {len(spec.stages)} stage(s), each a job under {spec.output.url.rstrip('/')}/stages/"]
    for i, (stage, stage_spec) in enumerate(zip(spec.stages, stage_specs, strict=True)):
        same = i and stage_spec.model == stage_specs[i - 1].model and \
            stage_spec.engine.factory == stage_specs[i - 1].engine.factory
        model = "as above" if i == 0 else (f"the same as stage {spec.stages[i - 1].name}'s (its own workers)"
                                           if same else check_model(stage_spec))
        reads = "the job's input" if i == 0 else ("a prompt template" if stage.input.prompt is not None else
                                                   f"{len(stage.input.messages)} message(s) appended")
        extra = (f"; output_columns {', '.join(stage.output_columns)}" if stage.output_columns else "") + \
            (f"; filter {stage.filter!r}" if stage.filter else "")
        lines.append(f"  stage {stage.name}: task {stage_spec.task}, reads {reads}{extra}; model {model}")
    problems = column_problems(spec, stage_specs, input_columns)
    lines += [f"  {p}" for p in problems]
    return lines, (f"{len(problems)} template / filter column(s) never exist upstream: {problems[0]}"
                   if problems else None)
