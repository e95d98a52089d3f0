"""`jobrunner report OUTPUT_URL ...`: throughput, latency, cache hit rate and cost of job outputs."""

from __future__ import annotations

import json
import math

import click

from jobrunner.cli.echo import echo

FORMATS = ("text", "json", "md", "html", "csv")


def _finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise click.BadParameter("must be a finite number >= 0")
    return value


def _storage_options(ctx: click.Context, param: click.Parameter, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        options = json.loads(value)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"endpoint_url\": \"http://...\"}'")
    return options


def _format(fmt: str | None, out: str | None) -> str:
    """--format, else guessed from --out's extension (.json, .md, .html), else text."""
    if fmt:
        return fmt
    suffix = (out or "").rsplit(".", 1)[-1].lower()
    return {"json": "json", "md": "md", "html": "html", "htm": "html", "csv": "csv"}.get(suffix, "text")


@click.command()
@click.argument("output_urls", nargs=-1, required=True, metavar="OUTPUT_URL [OUTPUT_URL ...]")
@click.option("--worker-hour-usd", type=float, callback=_finite,
              help="Price of one worker for one hour; default: the job spec's cost.worker_hour_usd.")
@click.option("--slo-ttft-s", type=float, callback=_finite,
              help="Goodput target for time to first token (default: the spec's cost.slo_ttft_s).")
@click.option("--slo-e2e-s", type=float, callback=_finite,
              help="Goodput target for end-to-end latency (default: the spec's cost.slo_e2e_s).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="Output format (default: from --out's extension, else text).")
@click.option("--out", default=None, help="Write to this file or fsspec URL instead of stdout.")
@click.option("--storage-options", callback=_storage_options, default=None,
              help="JSON object of fsspec storage options for the output URLs (e.g. an S3 endpoint_url).")
@click.option("--label", "labels", multiple=True, metavar="TEXT",
              help="Name of a run in the report, in OUTPUT_URL order (repeat: one per output).")
@click.option("--trend/--compare", "trend", default=None,
              help="A trend over run dates ($/M tokens, tokens/s, error rate, cache hit rate per run) or runs side "
                   "by side. Default: a trend when an OUTPUT_URL is a glob ('out/nightly/*'), else side by side.")
def report(output_urls: tuple[str, ...], worker_hour_usd: float | None, slo_ttft_s: float | None,
           slo_e2e_s: float | None, fmt: str | None, out: str | None, storage_options: dict | None,
           labels: tuple[str, ...], trend: bool | None) -> None:
    """Report throughput, latency percentiles, prefix-cache hit rate and $ per million tokens.

    Several OUTPUT_URLs (or a quoted glob of them) are shown side by side, with ratios against the first and
    the job-spec fields that differ; a glob, or --trend, shows them as a trend over run dates instead.
    """
    from jobrunner.io.report_reader import NothingCommittedYet, ReportInputError, expand_output_urls
    from jobrunner.reports import Slo, load_report
    from jobrunner.reports.compare import apply_labels

    try:
        urls, globbed = expand_output_urls(list(output_urls), storage_options)
        if len(labels) > len(urls):
            raise click.BadParameter(f"{len(labels)} labels for {len(urls)} output(s)", param_hint="--label")
    except ReportInputError as exc:
        raise click.ClickException(str(exc)) from None
    slo = Slo(ttft_s=slo_ttft_s, e2e_s=slo_e2e_s)
    if len(urls) == 1 and not globbed and _pipeline_report(urls[0], storage_options, worker_hour_usd, slo, fmt, out):
        return
    as_trend = globbed if trend is None else trend
    reports = []
    for url in urls:
        try:
            reports.append(load_report(url, storage_options, worker_hour_usd, slo))
        except NothingCommittedYet as exc:  # a night still starting (or stopped before its first commit)
            if not as_trend or len(urls) == 1 or labels:  # --label follows the URLs one to one
                raise click.ClickException(str(exc)) from None
            echo(f"warning: left out of the trend: {exc}", err=True)
        except (ValueError, OSError) as exc:  # ReportInputError, unreadable Parquet, storage errors
            message = str(exc) if url in str(exc) else f"{url}: {exc}"
            raise click.ClickException(message) from None
    apply_labels(reports, list(labels))
    _emit(_render(reports, _format(fmt, out), as_trend), out, storage_options)


def _pipeline_report(url: str, storage_options: dict | None, worker_hour_usd: float | None, slo: object,
                     fmt: str | None, out: str | None) -> bool:
    """A pipeline's output (reports/pipeline.py): its stages, funnel and $ / M kept rows; False for a job's."""
    from jobrunner.reports import pipeline

    if not pipeline.is_pipeline(url, storage_options):
        return False
    report = pipeline.load_pipeline_report(url, storage_options, worker_hour_usd, slo)
    renderers = {"text": pipeline.render_pipeline_text, "json": pipeline.render_pipeline_json,
                 "html": pipeline.render_pipeline_html}
    chosen = _format(fmt, out)
    if chosen not in renderers:
        raise click.ClickException(f"a pipeline's report comes as text, json or html, not {chosen}")
    _emit(renderers[chosen](report), out, storage_options)
    return True


def _render(reports: list[dict], fmt: str, as_trend: bool = False) -> str:
    from jobrunner.reports.html import render_html
    from jobrunner.reports.text import render_json, render_markdown, render_text
    from jobrunner.reports.trend import render_csv
    from jobrunner.reports.trend_render import (
        render_trend_html,
        render_trend_json,
        render_trend_markdown,
        render_trend_text,
    )

    renderers = {"text": render_text, "json": render_json, "md": render_markdown, "html": render_html,
                 "csv": render_csv}
    if as_trend:
        renderers.update(text=render_trend_text, json=render_trend_json, md=render_trend_markdown,
                         html=render_trend_html)
    return renderers[fmt](reports)


def _emit(text: str, out: str | None, storage_options: dict | None) -> None:
    if out is None:
        echo(text, nl=False)
        return
    from jobrunner.io.report_reader import write_text

    try:
        write_text(out, text, storage_options)
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc}") from None
    echo(f"wrote {out}", err=True)


COMMANDS = [report]
