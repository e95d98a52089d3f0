"""What a command prints, through the one redacting path (jobrunner.redaction): a Ray job's logs are readable by
whoever can list jobs, and a line may quote a URL, an option or an engine's error text."""

from __future__ import annotations

import click

from jobrunner.redaction import redact_text


def echo(text: object = "", err: bool = False, nl: bool = True) -> None:
    """`click.echo` of `text` redacted (stdout, or stderr with `err`)."""
    click.echo(redact_text(str(text)), err=err, nl=nl)


def redact_click_error(exc: click.exceptions.ClickException) -> None:
    """Scrub a ClickException's message in place before click prints it (ours and click's own)."""
    exc.message = redact_text(str(exc.message))
