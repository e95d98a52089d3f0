"""`jobrunner validate`'s lines about the rows: the columns it checked, the rows a worker would refuse (the
row check, driver/row_check.py) and the prompt lengths against the context (driver/length_check.py), all from
one read of the first rows."""

from __future__ import annotations

import time

from jobrunner.spec import JobSpec


def columns_line(spec: JobSpec) -> str:
    """'required columns present: prompt, id, ...' (each column once), or for an OpenAI batch file what each
    line must hold instead."""
    from jobrunner.driver.plan import required_columns

    if spec.input.format == "openai_batch":
        return ("request lines: each line's custom_id, method, url and body read (a line that is not a request is "
                "listed above as a bad line); each body is checked below as a worker reads it")
    keep = spec.output.keep_columns
    columns = list(required_columns(spec).values()) + (["* (every input column)"] if keep == "*" else keep)
    return f"required columns present: {', '.join(dict.fromkeys(columns))}"


def row_lines(spec: JobSpec, plan) -> tuple[list[str], str | None]:  # noqa: ANN001 - a driver.plan.JobPlan
    """validate's lines about the rows read, and the error refusing the job when a worker would refuse rows
    (None when it would not)."""
    if not plan.num_rows:
        return [], None
    from jobrunner.driver.row_check import check_rows, describe_refused, read_requests

    started = time.perf_counter()
    rows = read_requests(spec, plan)
    check = check_rows(spec, rows)
    read = f"{check.rows_read} of {plan.num_rows}" if check.rows_read < plan.num_rows else f"all {plan.num_rows}"
    lines = [f"rows checked as a worker reads them ({read} rows, {time.perf_counter() - started:.2f}s): "
             f"{len(check.refused) or 'none'} with a setting a worker refuses", *check.notes]
    refused = {rid for rid, _ in check.refused + check.no_prompt}
    lines += _prompt_length_lines(spec, plan, [r for r in rows.requests if r.row_id not in refused],
                                  len(rows.requests))
    return lines, describe_refused(check, plan.num_rows) if check.refused else None


def _prompt_length_lines(spec: JobSpec, plan, requests: list, rows_read: int) -> list[str]:  # noqa: ANN001
    """The rows' prompts tokenized as a worker would, against the context; skipped (with the reason) when the
    tokenizer is not on this machine."""
    if spec.engine.factory or not any(r.error is None and r.prompt is not None for r in requests):
        return []
    if spec.engine.backend == "openai":
        return ["prompt lengths not checked: the endpoint (engine.backend openai) knows its own context"]
    from jobrunner.driver.length_check import check_prompt_lengths, describe, tokenizer_for_check
    from jobrunner.models.preflight import ConfigUnavailable, preflight
    from jobrunner.models.sources import ModelSourceError

    tokenizer, why = tokenizer_for_check(spec.model.source)
    if tokenizer is None:
        return [why]
    try:
        check = preflight(spec.model.source, spec.engine.max_model_len)
    except (ModelSourceError, ConfigUnavailable) as exc:
        return [f"prompt lengths not checked: {exc}"]
    if check is None or not check.context:
        return ["prompt lengths not checked: the model's context is not known before its first load"]
    lengths = check_prompt_lengths(spec, requests, tokenizer, check.context)
    lengths.rows_read = rows_read  # the rows refused above were read too
    return describe(lengths, plan.num_rows)


def batch_chat_problem(spec: JobSpec) -> str | None:
    """`run`'s check before any worker: an OpenAI batch file whose first rows hold /v1/chat/completions lines,
    for a model known to have no chat template, refused in one line (validate names each line instead); None
    when that is not the case or the file cannot be read here (the run then says why)."""
    from jobrunner.driver.chat_check import is_chat_prompt, lacks_chat_template, no_template

    if spec.input.format != "openai_batch" or spec.task != "generate" or not lacks_chat_template(spec):
        return None
    from jobrunner.driver.plan import plan_job
    from jobrunner.driver.row_check import read_requests

    try:
        requests = read_requests(spec, plan_job(spec)).requests
    except Exception:  # noqa: BLE001 - an input problem: the run itself reports it, with its own words
        return None
    chats = [r.row_id for r in requests if r.error is None and is_chat_prompt(r.prompt)]
    if not chats:
        return None
    return (f"{len(chats)} of the first {len(requests)} request lines are /v1/chat/completions (custom_id "
            f"{chats[0]!r}, ...), but {no_template(spec)}; send them as /v1/completions prompts")
