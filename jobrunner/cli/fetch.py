"""`jobrunner fetch`: download or convert model sources into the local cache before a job needs them."""

from __future__ import annotations

import time

import click

from jobrunner.cli.echo import echo


@click.command()
@click.argument("sources", nargs=-1, required=True)
@click.option("--cache-dir", default=None, help="Cache root (default: $JOBRUNNER_CACHE, else ~/.cache/jobrunner).")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) for Hub ids.")
def fetch(sources: tuple[str, ...], cache_dir: str | None, revision: str | None) -> None:
    """Put each model SOURCE (alias, Hub id, storage URL or local dir) in the local cache, converted as a worker
    would load it, so that a job's workers on this node start without downloading or converting.

    A source already cached and current is only checked. Prints each model's local directory and the time it
    took; exits 1 naming the first source that cannot be fetched.
    """
    from jobrunner.models.sources import ModelSourceError, resolve_model_dir

    for source in sources:
        start = time.perf_counter()
        try:
            model_dir = resolve_model_dir(source, cache_dir=cache_dir, revision=revision)
        except ModelSourceError as exc:
            raise click.ClickException(f"fetch {source}: {exc}") from exc
        echo(f"{source}: {model_dir} ({time.perf_counter() - start:.1f} s)")


COMMANDS = [fetch]
