"""jobrunner.reports: throughput, latency percentiles, prefix-cache hit rate and cost per million tokens.

Pure computation and rendering over what `jobrunner.io.report_reader` streams out of a job's outputs.
"""

from jobrunner.io.report_reader import ReportInputError
from jobrunner.reports.fold import Slo
from jobrunner.reports.job import load_report, write_job_report

__all__ = ["ReportInputError", "Slo", "load_report", "write_job_report"]
