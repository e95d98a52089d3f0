"""How a job run ended: committed / failed shards, a job-level error, the error budget, and the summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from jobrunner.driver.incremental import DERIVED_HINT
from jobrunner.progress_view import Counts, duration
from jobrunner.redaction import redact_text
from jobrunner.startup_view import describe_startup, last_startup

MAX_LISTED_FAILURES = 20
LENGTH_WARN_SHARE = 0.05  # warn at the end of a run when more of its rows than this stopped at max_tokens


@dataclass
class JobResult:
    """How a run ended."""

    output_url: str
    manifest: dict[str, Any]
    failed: dict[str, str]  # shard_id -> error
    error: str | None = None  # the job could not run (no worker, lease lost)
    max_error_rate: float = 1.0
    top_errors: list[tuple[str, int]] = field(default_factory=list)
    finish_reasons: dict[str, int] = field(default_factory=dict)  # this run's rows by finish reason
    json_invalid: int = 0  # this run's rows whose text is not valid JSON for their schema
    max_tokens: int | None = None  # the job's sampling.max_tokens (named in the truncation warning)
    started_s: float | None = None  # when the command started (time.monotonic): the summary's elapsed time
    counts: Counts | None = None  # prompts / samples committed (progress_view.py)
    token_kind: str = "out"  # the tokens the job's task counts: "out" (generate) or "in" (embed / score)

    @property
    def error_rate(self) -> float:
        t = self.manifest["totals"]
        return t["num_errors"] / t["rows"] if t["rows"] else 0.0

    @property
    def over_error_budget(self) -> bool:
        """More error rows than output.max_error_rate allows, or every row an error."""
        t = self.manifest["totals"]
        return t["rows"] > 0 and (self.error_rate > self.max_error_rate or t["num_errors"] == t["rows"])

    @property
    def ok(self) -> bool:
        return not self.failed and self.error is None and not self.over_error_budget

    def summary(self, failures: bool = True) -> str:
        """A short human summary (names failed shards, the error share and the top error kinds), redacted.

        failures=False leaves out the job error and the failed shards, for a caller that prints
        `failure_message()` right after (each error is printed once)."""
        return redact_text(self._summary(failures))

    def _summary(self, failures: bool) -> str:
        t = self.manifest["totals"]
        done = f"{t['rows']} rows" if self.counts is None else self.counts.text()
        tokens = (f"{t['num_output_tokens']} output tokens" if self.token_kind == "out" else
                  f"{t['num_prompt_tokens']} input tokens")
        # the command's wall time, measured now (the summary is its last line), else the run's
        wall = (f"elapsed {duration(time.monotonic() - self.started_s)}" if self.started_s is not None else
                f"wall {self.manifest['wall_s']:.1f}s")
        errors = f"{t['num_errors']} error row{'' if t['num_errors'] == 1 else 's'}"
        text = (f"{self.manifest['job_name']}: {t['shards_committed']}/{t['shards_total']} shards committed, "
                f"{done}, {errors} ({100 * self.error_rate:.1f}% of rows), {tokens}, {wall} -> {self.output_url}")
        text += _incremental_line(self.manifest)
        startup = describe_startup(last_startup(self.manifest))
        text += f"\n  start-up: {startup}" if startup else ""
        for kind, count in self.top_errors:
            text += f"\n  {count} error row{'' if count == 1 else 's'}: {kind}"
        for warning in self.row_warnings():
            text += f"\n  WARNING: {warning}"
        if not failures:
            return text
        if self.error:
            text += f"\n  JOB ERROR: {self.error}"
        failed = sorted(self.failed.items())
        for shard_id, error in failed[:MAX_LISTED_FAILURES]:
            text += f"\n  FAILED shard {shard_id}: {error}"
        if len(failed) > MAX_LISTED_FAILURES:
            text += f"\n  ... and {len(failed) - MAX_LISTED_FAILURES} more failed shards (see _manifest.json)"
        return text

    def row_warnings(self) -> list[str]:
        """What this run's rows say that the user should see: many rows cut at max_tokens (more than 5%; a
        truncated answer, or JSON cut mid-value), rows whose JSON does not satisfy their schema."""
        warnings = []
        rows = sum(self.finish_reasons.values())
        length = self.finish_reasons.get("length", 0)
        if rows and length / rows > LENGTH_WARN_SHARE:
            setting = f"sampling.max_tokens={self.max_tokens}" if self.max_tokens else "sampling.max_tokens"
            warnings.append(f"{length} of {rows} rows of this run ({100 * length / rows:.1f}%) stopped at the "
                            f"token limit ({setting}) before the model ended them: raise {setting.split('=')[0]} "
                            "if their answers are cut (finish_reason 'length' in the output)")
        if self.json_invalid:
            warnings.append(f"{self.json_invalid} rows of this run are not valid JSON for their schema "
                            "(json_valid false in the output; most often cut at max_tokens)")
        return warnings

    def failure_message(self) -> str:
        """Why the job exits non-zero (empty when ok), redacted."""
        return redact_text(self._failure_reasons())

    def _failure_reasons(self) -> str:
        reasons = []
        if self.error:
            reasons.append(self.error)
        if self.failed:
            failed = sorted(self.failed.items())
            more = len(failed) - MAX_LISTED_FAILURES
            reasons.append(f"{len(failed)} shard(s) failed" + (f" ({more} more in _manifest.json)" if more > 0 else ""))
            reasons += [f"  shard {shard_id}: {error}" for shard_id, error in failed[:MAX_LISTED_FAILURES]]
        if self.over_error_budget:
            kinds = "; ".join(f"{k} ({n})" for k, n in self.top_errors[:3])
            reasons.append(f"{100 * self.error_rate:.1f}% of rows are errors (output.max_error_rate="
                           f"{self.max_error_rate:g}); top errors: {kinds}")
            reasons.append("  every row is written (error rows keep their id and full error, line numbers "
                           "included); to go on, either accept them: rerun with a higher output.max_error_rate "
                           "(nothing is recomputed), or fix the input and rerun with output.mode=overwrite")
        return "\n".join(reasons)


def _incremental_line(manifest: dict[str, Any]) -> str:
    """What an incremental run took and skipped (manifest `incremental`, driver/incremental.py), or ''."""
    plan = manifest.get("incremental")
    if not plan or not (manifest.get("runs") or [{}])[-1].get("incremental"):
        return ""
    text = (f"\n  incremental: {plan['rows_taken']} of {plan['rows_input']} input rows taken, "
            f"{plan['rows_skipped']} skipped as done ({plan['done_ids']} done ids)")
    if plan.get("changed_requests"):
        shown = ", ".join(repr(c["id"]) for c in plan.get("changed") or [])
        text += (f"\n  WARNING: {plan['changed_requests']} done id(s) have a changed request since their output "
                 f"row was written; skipped, not rerun (each id is done once; to redo them, write them to a new "
                 f"output or remove their rows): {shown}")
        text += DERIVED_HINT if plan.get("derived_ids") else ""
    return text
