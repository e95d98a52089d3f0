"""An output URL given as the job spec that writes it (`jobrunner status nightly.yaml`): the spec's `output.url`
with `{date}` and the other placeholders filled as a run started now would fill them ($JOBRUNNER_DATE first)."""

from __future__ import annotations

import os

import click

SPEC_SUFFIXES = (".yaml", ".yml")
PER_RUN = ("run_id", "datetime")  # placeholders that differ at every run: no spec names an earlier run by them


def is_spec_path(arg: str) -> bool:
    """Whether `arg` names a job spec (an existing .yaml / .yml file) rather than an output URL."""
    return arg.lower().endswith(SPEC_SUFFIXES) and os.path.isfile(arg)


def output_of(arg: str, storage_options: dict | None) -> tuple[str, dict | None]:
    """(output URL, storage options) for `arg`: an output URL as given, or a job spec's resolved `output.url`
    and, unless given, its `output.storage_options`; a bad spec is a one-line click error naming the file."""
    if not is_spec_path(arg):
        return arg, storage_options
    from jobrunner.spec import SpecError, load_spec, load_spec_data

    try:
        spec = load_spec(arg)
        written = load_spec_data(arg)[0]["output"]["url"]  # as written: its placeholders unfilled
    except SpecError as exc:
        raise click.ClickException(str(exc)) from None
    for name in PER_RUN:
        if isinstance(written, str) and "{" + name + "}" in written:
            raise click.ClickException(f"{arg}: output.url {written!r} holds {{{name}}}, new at every run: give the "
                                       "run's output URL instead")
    return spec.output.url, storage_options if storage_options is not None else spec.output.storage_options
