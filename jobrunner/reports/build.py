"""Turn one job's outputs into a report dict (the content of report.json); renderers only format it."""

from __future__ import annotations

import posixpath

from jobrunner.io.report_reader import JobOutputs, iter_metric_batches, planned_nothing
from jobrunner.prefix_view import ideal_over_covered
from jobrunner.redaction import redact, redact_counts
from jobrunner.reports import manifest_view as mv
from jobrunner.reports.accumulators import OTHER_KINDS
from jobrunner.reports.cost import (
    cost_figures,
    goodput_cost,
    per_million,
    ratio,
    startup_cost,
    steady_state_cost,
    token_priced_cost,
    without_worker_hour_notes,
)
from jobrunner.reports.fold import Folded, Slo, fold_batches
from jobrunner.reports.images import image_block, image_warnings, split_cost, split_tokens
from jobrunner.startup_view import describe_stages, last_startup

REPORT_VERSION = 1


def build_report(outputs: JobOutputs, worker_hour_usd: float | None = None, slo: Slo | None = None,
                 batch_rows: int = 65_536) -> dict:
    """Read the metric columns of `outputs` once and compute every figure of the report."""
    manifest = outputs.manifest
    slo = _slo(manifest, slo or Slo())
    folded = fold_batches(iter_metric_batches(outputs, batch_rows), slo)
    price, price_source = mv.price_and_source(manifest, worker_hour_usd)
    time = _time(manifest, folded)
    if planned_nothing(outputs):  # no worker was started: nothing was paid for
        time.update(worker_seconds=time["worker_seconds"] or 0.0, num_workers=0)
    task = mv.task_info(manifest)
    cost = cost_figures(time["worker_seconds"], price, folded.input_tokens, folded.output_tokens,
                        time["prefill_s"], time["decode_s"], prefill_only=task["task"] != "generate")
    cost["price_source"] = price_source
    cost["startup_usd"] = startup_cost(time["startup_seconds"], price)
    cost["lost_usd"] = startup_cost(time["lost_worker_seconds"], price)
    cost["steady_state"] = steady_state_cost(
        time["worker_seconds"], (time["startup_seconds"] or 0.0) + (time["lost_worker_seconds"] or 0.0), price,
        folded.input_tokens, folded.output_tokens, time["prefill_s"], time["decode_s"],
        prefill_only=task["task"] != "generate")
    cost.update(reasoning_cost(cost, folded.output_tokens, folded.reasoning_tokens))
    cost["token_priced"] = token_priced_cost(  # an endpoint's price list, beside the worker-hour price
        folded.input_tokens, folded.output_tokens, mv.number(mv.spec_cost(manifest), "usd_per_m_input"),
        mv.number(mv.spec_cost(manifest), "usd_per_m_output"), mv.spent_usd(manifest))
    if cost["token_priced"] is not None:  # priced per token: the worker-hour price's notes are noise
        cost["notes"] = without_worker_hour_notes(cost["notes"])
    cost["notes"] += run_notes(time["runs"])
    images = image_block(folded.image_figures)
    tokens = _tokens(folded, manifest)
    split_tokens(tokens, images)
    split_cost(cost, tokens, images)
    return {
        "report_version": REPORT_VERSION,
        "run": redact(_run(outputs, folded)),  # the report is shared: URLs and model sources lose credentials
        "rows": _rows(folded),
        "dedupe": (manifest or {}).get("dedupe"),  # output.dedupe: the plan's / the outputs' counts (driver/dedupe.py)
        "tokens": tokens,
        "images": images,  # None when the rows cannot carry images (reports/images.py)
        "adapters": _adapters(folded),
        "time": time,
        "throughput": _throughput(folded, time),
        "latency_s": {name: values.summary() for name, values in folded.latencies.items()},
        "cost": cost,
        "goodput": _goodput(folded, slo, cost),
        "charts": _charts(folded, time["wall_s"]),
        "warnings": redact(_warnings(outputs, folded, time) + image_warnings(images)),
    }


def _slo(manifest: dict | None, given: Slo) -> Slo:
    """Targets from the command line, else the job spec's `cost.slo_ttft_s` / `cost.slo_e2e_s`."""
    spec = mv.spec_cost(manifest)
    ttft = given.ttft_s if given.ttft_s is not None else mv.number(spec, "slo_ttft_s")
    e2e = given.e2e_s if given.e2e_s is not None else mv.number(spec, "slo_e2e_s")
    return Slo(ttft_s=ttft, e2e_s=e2e)


def _run(outputs: JobOutputs, folded: Folded) -> dict:
    manifest = outputs.manifest or {}
    job_name = mv.text(manifest, "job_name")
    started = mv.text(manifest, "started_at")
    return {
        "label": job_name or posixpath.basename(outputs.root.rstrip("/")) or outputs.url,
        "url": outputs.url,
        "job_name": job_name,
        "model": mv.model_info(manifest),
        "task": mv.task_info(manifest),
        "jobrunner_version": mv.text(manifest, "jobrunner_version"),
        "started_at": started,
        # the night the run belongs to ({date} / $JOBRUNNER_DATE when it ran); older manifests: its start date
        "date": mv.text(manifest, "logical_date") or (started[:10] if started else None),
        "hardware": mv.hardware(manifest),
        "tensor_parallel": _tensor_parallel(manifest),  # None for a model on one rank
        "startup_end_s": folded.first_arrival_s,
        "spec": manifest.get("spec") if isinstance(manifest.get("spec"), dict) else {},
        "finished_at": mv.text(manifest, "finished_at"),
        "complete": outputs.is_complete,
        "num_parts": len(outputs.part_paths),
        "shards": mv.shard_counts(manifest),
    }


def _tensor_parallel(manifest: dict) -> dict | None:
    """The model's tensor-parallel split (reports/parallel_view.py) with its one-line ``summary``."""
    from jobrunner.reports.parallel_view import describe_groups, describe_split, model_split

    split = model_split(manifest)
    if split is None:
        return None
    return {**split, "summary": describe_split(split), "ranks_text": describe_groups(split) or None}


def _top_kinds(kind_to_count: dict[str, int], limit: int = 20) -> dict[str, int]:
    """The `limit` most frequent error kinds, the rest summed into one entry."""
    ranked = sorted(kind_to_count.items(), key=lambda kv: (-kv[1], kv[0]))
    top = dict(ranked[:limit])
    rest = sum(count for _, count in ranked[limit:])
    if rest:
        top[OTHER_KINDS] = top.get(OTHER_KINDS, 0) + rest
    return top


def _rows(folded: Folded) -> dict:
    kinds = _top_kinds(redact_counts(folded.error_kind_to_count))
    length = folded.finish_reason_to_count.get("length", 0)
    checked = sum(folded.json_valid_to_count.values())
    invalid = folded.json_valid_to_count.get(False, 0)
    return {"total": folded.rows, "ok": folded.rows - folded.errors, "errors": folded.errors,
            "error_rate": ratio(folded.errors, folded.rows), "errors_by_kind": kinds,
            "finish_reasons": dict(sorted(folded.finish_reason_to_count.items())),
            "stopped_at_max_tokens": length, "stopped_at_max_tokens_rate": ratio(length, folded.rows),
            # rows checked against a JSON schema (json_valid true or false); None: no row had a schema
            "json_checked": checked or None, "json_invalid": invalid if checked else None,
            "json_valid_rate": ratio(checked - invalid, checked) if checked else None}


def _adapters(folded: Folded) -> dict | None:
    """Per LoRA adapter (and the base model): rows, errors, input / cached / output tokens, prefix-cache hit
    rate; None when the rows name no adapter (the job has no input.adapter_column)."""
    if folded.adapter_figures is None:
        return None
    out = {}
    for name, figures in sorted(folded.adapter_figures.items()):
        rows, errors, prompt, cached, output = figures
        out[name] = {"rows": rows, "errors": errors, "input_tokens": prompt, "cached_tokens": cached,
                     "output_tokens": output, "prefix_cache_hit_rate": ratio(cached, prompt)}
    return out


def _tokens(folded: Folded, manifest: dict | None) -> dict:
    ideal = _ideal_cached_tokens(manifest, folded)
    covered_prompt, covered_cached, ideal = ideal if ideal is not None else (None, None, None)
    return {"input": folded.input_tokens, "cached": folded.cached_tokens, "output": folded.output_tokens,
            "total": folded.input_tokens + folded.output_tokens,
            "prefix_cache_hit_rate": ratio(folded.cached_tokens, folded.input_tokens),
            # the ideal and its share over the shards whose prompt chains the manifest counted (prefix_view.py)
            "ideal_cached": ideal, "ideal_prefix_cache_hit_rate": ratio(ideal, covered_prompt),
            "prefix_cache_of_ideal": ratio(covered_cached, ideal), "ideal_covers_input_tokens": covered_prompt,
            # output tokens that were a reasoning trace, and the rest (the answers); None without a parser
            "reasoning": folded.reasoning_tokens,
            "answer": None if folded.reasoning_tokens is None else folded.output_tokens - folded.reasoning_tokens}


def _ideal_cached_tokens(manifest: dict | None, folded: Folded) -> tuple[int, int, int] | None:
    """(input tokens, cached tokens, ideal cached tokens) over the shards whose prompt chains the manifest's
    `prefix_cache` counted (driver/prefix_rows.py defines the ideal: cached tokens if every distinct shared
    prefix were computed once); None for outputs written before it. The rows' own totals where the manifest
    does not say which tokens its ideal covers."""
    section = (manifest or {}).get("prefix_cache")
    if not isinstance(section, dict) or not isinstance(section.get("ideal_cached_tokens"), (int, float)):
        return None
    totals = {"num_prompt_tokens": folded.input_tokens, "num_cached_tokens": folded.cached_tokens}
    return ideal_over_covered(section, totals)


def _time(manifest: dict | None, folded: Folded) -> dict:
    """Wall time from the manifest (else the last row's finish time), worker-seconds and engine time."""
    wall = mv.number(manifest, "wall_s")
    wall_source = "manifest"
    if wall is None or wall <= 0:
        wall, wall_source = (folded.max_finish_time_s or None), "last row finish time"
    prefill, decode = mv.engine_seconds(manifest)
    num_workers = len(mv.workers(manifest)) or None
    startup = last_startup(manifest) or {}
    first = (startup.get("workers") or {}).get(startup.get("first")) or {}
    return {"wall_s": wall, "wall_source": wall_source, "worker_seconds": mv.worker_seconds(manifest),
            "startup_seconds": mv.startup_seconds(manifest), "plan_s": startup.get("plan_s"),
            "lost_worker_seconds": mv.number(manifest, "totals", "lost_worker_seconds"),
            "num_runs": mv.num_runs(manifest), "runs": mv.run_costs(manifest),
            "ray_start_s": startup.get("ray_start_s"), "first_ready_s": first.get("ready_s"),
            "first_token_s": first.get("first_token_s"),
            "startup_stages": describe_stages(startup.get("stages") or {}) or None,
            "num_workers": num_workers, "prefill_s": prefill, "decode_s": decode}


def _throughput(folded: Folded, time: dict) -> dict:
    """Per second of wall time (the job) and per worker-second (one worker)."""
    total = folded.input_tokens + folded.output_tokens
    figures = {}
    for suffix, seconds in (("per_s", time["wall_s"]), ("per_worker_s", time["worker_seconds"])):
        figures[f"tokens_{suffix}"] = ratio(total, seconds)
        figures[f"input_tokens_{suffix}"] = ratio(folded.input_tokens, seconds)
        figures[f"output_tokens_{suffix}"] = ratio(folded.output_tokens, seconds)
        figures[f"rows_{suffix}"] = ratio(folded.rows, seconds)
    return figures


def _goodput(folded: Folded, slo: Slo, cost: dict) -> dict | None:
    if not slo.is_set:
        return None
    return {
        "slo_ttft_s": slo.ttft_s, "slo_e2e_s": slo.e2e_s,
        "rows_met": folded.good_rows, "row_share": ratio(folded.good_rows, folded.rows),
        "output_tokens_met": folded.good_output_tokens,
        "output_token_share": ratio(folded.good_output_tokens, folded.output_tokens),
        "input_tokens_met": folded.good_input_tokens,
        "cost": goodput_cost(cost, folded.good_input_tokens, folded.good_output_tokens),
    }


def _charts(folded: Folded, wall_s: float | None) -> dict:
    output = folded.output_timeline.rate_series(wall_s)
    input_ = folded.input_timeline.rate_series(wall_s)
    return {
        "latency_cdf": {name: values.cdf() for name, values in folded.latencies.items()},
        "output_tokens_per_s": output,
        "input_tokens_per_s": input_,
    }


def _no_rows_warning(outputs: JobOutputs) -> str:
    if not planned_nothing(outputs):
        return "the outputs hold no rows"
    plan = (outputs.manifest or {}).get("incremental")
    if isinstance(plan, dict) and isinstance(plan.get("rows_input"), int):
        return (f"nothing to do: the run took 0 of {plan['rows_input']:,} input rows "
                f"({plan.get('rows_skipped', 0):,} done already); a valid output of 0 rows")
    return "nothing to do: the run planned no shard (an empty input); a valid output of 0 rows"


def run_notes(runs: list[dict]) -> list[str]:
    """One line per run when the job took several, or its one run did not finish: what each paid for."""
    if len(runs) < 2 and all(r.get("status") in (None, "finished") for r in runs):
        return []
    lines = []
    for run in runs:
        seconds = run.get("worker_seconds")
        paid = "worker-seconds not recorded" if seconds is None else (
            f"{seconds:,.1f} worker-s, of which start-up {run.get('startup_seconds') or 0:,.1f}, "
            f"paid for work later redone / lost {run.get('lost_worker_seconds') or 0:,.1f}")
        wall = run.get("wall_s")
        lines.append(f"run {run['run_index']} ({run.get('status') or 'finished'}, "
                     f"{'wall n/a' if wall is None else f'wall {wall:,.1f} s'}): {paid}")
    return lines


LENGTH_WARN_SHARE = 0.05  # more rows than this cut at max_tokens: a warning


def reasoning_cost(cost: dict, output_tokens: int, reasoning_tokens: int | None) -> dict:
    """The output cost split between reasoning and answers (by token count: a decode step costs the same
    whichever it writes), and $ per million answer tokens (what an answer token costs, its trace paid)."""
    if not reasoning_tokens:
        return {"reasoning_usd": None, "usd_per_m_answer": None}
    output_usd = cost.get("output_usd")
    reasoning_usd = None if output_usd is None else output_usd * ratio(reasoning_tokens, output_tokens)
    return {"reasoning_usd": reasoning_usd,
            "usd_per_m_answer": per_million(output_usd, output_tokens - reasoning_tokens)}


def _warnings(outputs: JobOutputs, folded: Folded, time: dict) -> list[str]:
    warnings = list(outputs.warnings)
    if outputs.manifest is None:
        warnings.append("no _manifest.json: worker-seconds, engine time and cost are unavailable")
    if not outputs.is_complete:
        warnings.append("no _SUCCESS marker: the job has not finished; figures cover committed shards only")
    failed = mv.shard_counts(outputs.manifest).get("failed", 0)
    if failed:
        warnings.append(f"{failed} shard(s) failed: their rows are not in this report")
    if folded.rows == 0:
        warnings.append(_no_rows_warning(outputs))
    elif folded.errors == folded.rows:
        warnings.append("every row failed: no latency, throughput or per-token cost to report")
    length = folded.finish_reason_to_count.get("length", 0)
    if folded.rows and length / folded.rows > LENGTH_WARN_SHARE:
        max_tokens = mv.spec_section(outputs.manifest, "sampling").get("max_tokens")
        setting = f"sampling.max_tokens={max_tokens}" if max_tokens else "sampling.max_tokens"
        warnings.append(f"{length:,} of {folded.rows:,} rows ({100 * length / folded.rows:.1f}%) stopped at the token "
                        f"limit ({setting}) before the model ended them: raise it if their answers are cut")
    invalid = folded.json_valid_to_count.get(False, 0)
    if invalid:
        warnings.append(f"{invalid:,} rows are not valid JSON for their schema (json_valid false)")
    if time["wall_source"] != "manifest":
        warnings.append("wall time taken from the last row's finish time (manifest has none)")
    return warnings
