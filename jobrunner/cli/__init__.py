"""The `jobrunner` command line: thin click commands over the library.

Each command lives in its own module (job.py: run/validate/submit, report.py, bench.py, status.py, jobs.py) so that the
commands stay small; heavy imports (torch, ray) happen inside the commands, not at import time.
"""

import click


@click.group()
@click.version_option(package_name="jobrunner")
def main() -> None:
    """jobrunner: batch LLM inference jobs on Ray with our own continuous-batching engine."""


def _register() -> None:
    import importlib

    for module in ("job", "report", "bench", "status", "jobs"):
        try:
            mod = importlib.import_module(f"jobrunner.cli.{module}")
        except ModuleNotFoundError as exc:  # a command module not written yet
            if exc.name != f"jobrunner.cli.{module}":
                raise
            continue
        for command in getattr(mod, "COMMANDS", []):
            main.add_command(command)


_register()
