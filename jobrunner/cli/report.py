"""`jobrunner report OUTPUT_URL ...`: throughput, latency, cache hit rate and cost of job outputs."""

from __future__ import annotations

import json
import math

import click

from jobrunner.redaction import redact_text

FORMATS = ("text", "json", "md", "html")


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
    return {"json": "json", "md": "md", "html": "html", "htm": "html"}.get(suffix, "text")


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
def report(output_urls: tuple[str, ...], worker_hour_usd: float | None, slo_ttft_s: float | None,
           slo_e2e_s: float | None, fmt: str | None, out: str | None, storage_options: dict | None) -> None:
    """Report throughput, latency percentiles, prefix-cache hit rate and $ per million tokens.

    Several OUTPUT_URLs are shown side by side, with ratios against the first.
    """
    from jobrunner.reports import Slo, load_report

    slo = Slo(ttft_s=slo_ttft_s, e2e_s=slo_e2e_s)
    reports = []
    for url in output_urls:
        try:
            reports.append(load_report(url, storage_options, worker_hour_usd, slo))
        except (ValueError, OSError) as exc:  # ReportInputError, unreadable Parquet, storage errors
            message = str(exc) if url in str(exc) else f"{url}: {exc}"
            raise click.ClickException(redact_text(message)) from None
    _emit(_render(reports, _format(fmt, out)), out, storage_options)


def _render(reports: list[dict], fmt: str) -> str:
    from jobrunner.reports.html import render_html
    from jobrunner.reports.text import render_json, render_markdown, render_text

    renderers = {"text": render_text, "json": render_json, "md": render_markdown, "html": render_html}
    return renderers[fmt](reports)


def _emit(text: str, out: str | None, storage_options: dict | None) -> None:
    if out is None:
        click.echo(text, nl=False)
        return
    from jobrunner.io.report_reader import write_text

    try:
        write_text(out, text, storage_options)
    except OSError as exc:
        raise click.ClickException(redact_text(f"cannot write {out}: {exc}")) from None
    click.echo(redact_text(f"wrote {out}"), err=True)


COMMANDS = [report]
