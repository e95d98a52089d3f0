"""`jobrunner doctor`: this machine as the engine sees it: the CPU capability, the native libraries, and every
``JOBRUNNER_*`` switch with its current value (the table of :mod:`jobrunner.kernels.switches`)."""

from __future__ import annotations

import json

import click

from jobrunner.cli.echo import echo


@click.command()
@click.option("--build", "build", is_flag=True,
              help="Also build and load every native library for this CPU (a few seconds each on a first run).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
def doctor(build: bool, as_json: bool) -> None:
    """Print the detected (or forced) CPU capability, the native libraries' state with --build, and every
    JOBRUNNER_* environment variable: its current value, default, where it applies and what it chooses."""
    from jobrunner.kernels import switches

    report = {"capability": _capability(), "switches": switches.table()}
    if build:
        report["libraries"] = _libraries()
    if as_json:
        echo(json.dumps(report, indent=1))
        return
    echo(f"CPU capability: {report['capability']}")
    for name, state in report.get("libraries", {}).items():
        echo(f"  {name}: {state}")
    echo("switches (unset: the default; '-': the capability decides):")
    for row in report["switches"]:
        value = row["value"] or "(unset)"
        echo(f"  {row['name']}={value}  default {row['default'] or '-'}; {row['kind']}; applies: {row['applies']}")
        echo(f"      {row['chooses']}")


def _capability() -> str:
    """``avx512_bf16 (detected)`` or ``avx2 (forced by JOBRUNNER_CPU_CAPABILITY)``, or the setting's error."""
    from jobrunner.kernels import CAPABILITY_ENV, detect_cpu_capability

    try:
        capability, forced = detect_cpu_capability()
    except ValueError as exc:
        return f"error: {exc}"
    return f"{capability} ({f'forced by {CAPABILITY_ENV}' if forced else 'detected'})"


def _libraries() -> dict[str, str]:
    """Each native library: ``ok (<path>)`` or why it cannot run here."""
    from jobrunner.kernels import LIBRARIES, build_library, load

    out = {}
    for name in LIBRARIES:
        lib = load(name)
        out[name] = lib if isinstance(lib, str) else f"ok ({build_library(name)})"
    return out


COMMANDS = [doctor]
