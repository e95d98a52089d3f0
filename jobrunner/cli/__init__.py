"""The `jobrunner` command line: thin click commands over the library.

Each command lives in its own module (job.py: run/validate/submit, report.py, bench.py, status.py, jobs.py) so that the
commands stay small; heavy imports (torch, ray) happen inside the commands, not at import time.
"""

import traceback

import click

from jobrunner.cli.echo import echo, redact_click_error


class _Main(click.Group):
    """The command group. An unexpected error's traceback is printed redacted (a Ray job's logs are readable by
    whoever can list jobs; a traceback quotes URLs and options), then the command exits 1; an error for the
    user (ClickException) has its message redacted before click prints it."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.exceptions.ClickException as exc:  # its message is printed by click: scrubbed first
            redact_click_error(exc)
            raise
        except (click.exceptions.Exit, click.exceptions.Abort, SystemExit, KeyboardInterrupt):
            raise
        except Exception:  # noqa: BLE001 - shown to the user, then exit 1
            echo(traceback.format_exc(), err=True)
            ctx.exit(1)


@click.group(cls=_Main)
@click.version_option(package_name="jobrunner")
def main() -> None:
    """jobrunner: batch LLM inference jobs on Ray with our own continuous-batching engine."""


def _register() -> None:
    import importlib

    for module in ("job", "report", "bench", "status", "jobs", "fetch", "doctor"):
        try:
            mod = importlib.import_module(f"jobrunner.cli.{module}")
        except ModuleNotFoundError as exc:  # a command module not written yet
            if exc.name != f"jobrunner.cli.{module}":
                raise
            continue
        for command in getattr(mod, "COMMANDS", []):
            main.add_command(command)


_register()
