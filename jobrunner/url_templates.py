"""``{date}``, ``{datetime}`` and ``{run_id}`` in the input and output URLs of a job spec.

A nightly pipeline writes each night to its own folder (``s3://b/nightly/{date}/``) without editing the spec.
The values are fixed once per spec load (one run id, one clock reading for every URL of that spec):

- ``{date}``: the UTC date, ``2026-12-03`` — or ``$JOBRUNNER_DATE`` when set, so a scheduler can pass its
  logical date and a rerun after midnight resumes the night it belongs to;
- ``{datetime}``: the UTC time to the second, ``2026-12-03T01-30-00Z`` (no ``:``, which some stores and
  shells mishandle) — or ``$JOBRUNNER_DATETIME``;
- ``{run_id}``: 12 random hex digits — or ``$JOBRUNNER_RUN_ID``.

Only these names are placeholders; any other ``{word}`` is refused naming the field, so a typo such as
``{data}`` never becomes a literal folder. Braces holding anything else (a glob's ``{a,b}``) stay as written.
``${env:NAME}`` references are resolved before, where the spec is loaded (``jobrunner.spec``).
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Callable, Mapping

from jobrunner.kernels.switches import is_set, setting

TEMPLATE_FIELDS = (("input", "url"), ("output", "url"))
PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")
ENV_OVERRIDES = {"date": "JOBRUNNER_DATE", "datetime": "JOBRUNNER_DATETIME", "run_id": "JOBRUNNER_RUN_ID"}


def template_values(now: dt.datetime | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The placeholder values for one spec load (environment overrides first). ``date`` is also the run's
    logical date, which the manifest records and the trend of a series of runs is keyed by (a night rerun
    or backfilled with ``$JOBRUNNER_DATE`` lands on its own date, whatever the clock says)."""
    now = now or dt.datetime.now(dt.timezone.utc)
    values = {"date": now.strftime("%Y-%m-%d"), "datetime": now.strftime("%Y-%m-%dT%H-%M-%SZ"),
              "run_id": uuid.uuid4().hex[:12]}
    for name, variable in ENV_OVERRIDES.items():
        if is_set(variable, environ):
            values[name] = setting(variable, environ)
    if is_set(ENV_OVERRIDES["date"], environ):
        check_date(values["date"])
    return values


def check_date(value: str) -> None:
    """ValueError naming $JOBRUNNER_DATE unless ``value`` is a calendar date written YYYY-MM-DD: it names the
    night's folder and orders the trend, so ``2026-12-4`` (which sorts after ``2026-12-10``) is refused."""
    try:
        ok = dt.date.fromisoformat(value).isoformat() == value
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"${ENV_OVERRIDES['date']}={value!r}: write the night's date as YYYY-MM-DD (e.g. 2026-12-04)")


def has_placeholders(url: str) -> bool:
    """Whether ``url`` holds a ``{name}`` placeholder (any name)."""
    return bool(PLACEHOLDER.search(url))


def fill_url(url: str, values: Mapping[str, str], field: str,
             error: Callable[[str], Exception] = ValueError) -> str:
    """``url`` with each placeholder replaced; ``error(message)`` is raised for an unknown name."""
    def one(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            known = ", ".join("{" + n + "}" for n in values)
            raise error(f"{field}: unknown placeholder {{{name}}} in {url!r}; the known ones are {known}")
        return values[name]

    return PLACEHOLDER.sub(one, url)


def fill_spec_urls(data: dict, source: str, error: Callable[[str], Exception] = ValueError,
                   values: Mapping[str, str] | None = None) -> dict:
    """A copy of spec dict ``data`` with the placeholders of its input and output URLs filled in (one set of
    values for both); other fields are left as written."""
    values = values or template_values()
    out = dict(data)
    for section, key in TEMPLATE_FIELDS:
        part = out.get(section)
        if isinstance(part, dict) and isinstance(part.get(key), str) and has_placeholders(part[key]):
            out[section] = {**part, key: fill_url(part[key], values, f"{source}: {section}.{key}", error)}
    return out

