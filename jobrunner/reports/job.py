"""Load reports from output URLs and write _report/report.json and _report/report.html under a job's output."""

from __future__ import annotations

from jobrunner.io.layout import REPORT_FILES
from jobrunner.io.report_reader import open_outputs, write_report_files
from jobrunner.redaction import redact_text
from jobrunner.reports.build import build_report
from jobrunner.reports.fold import Slo


def load_report(output_url: str, storage_options: dict | None = None, worker_hour_usd: float | None = None,
                slo: Slo | None = None) -> dict:
    """Build the report of one job output; `ReportInputError` (a ValueError) says what is wrong with it."""
    return build_report(open_outputs(output_url, storage_options), worker_hour_usd, slo)


def write_job_report(output_url: str, storage_options: dict | None = None,
                     worker_hour_usd: float | None = None) -> dict:
    """Write _report/report.json and _report/report.html under `output_url`; return the report (or {"error": ...}).

    Called when a job ends. It never raises: a report problem is returned as {"error": message} (the caller
    says it, once) so that it cannot hide the job's own result.
    """
    from jobrunner.reports.html import render_html
    from jobrunner.reports.text import render_json

    try:
        report = load_report(output_url, storage_options, worker_hour_usd)
        json_key, html_key = REPORT_FILES
        paths = write_report_files(output_url, {json_key: render_json([report]), html_key: render_html([report])},
                                   storage_options)
    except Exception as exc:  # noqa: BLE001 - a report must never fail the job
        return {"error": redact_text(f"{type(exc).__name__}: {exc}")}
    report["files"] = paths
    return report
