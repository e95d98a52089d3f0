"""Which endpoint answers are the job's misconfiguration rather than one row's error, and what to tell the user.

Every row of a job goes to the same URL with the same key and model, so a wrong key (401 / 403), a wrong path or
model (404), or a server nobody answers at (connection refused, a host name that does not resolve, after the
retries) would fail every row alike: the engine stops the job instead (EngineStopped, resumable), naming the
URL (without credentials), the status and the fix. 400 / 422, timeouts and 5xx after the retries stay rows'
errors: they may be the row's own (too long a prompt, a bad schema) or the server's passing trouble.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit, urlunsplit

JOB_STATUSES = frozenset({401, 403, 404})


def unreachable(exc: BaseException) -> bool:
    """Whether a failed connection means no server at that address (refused, or the host name unknown)."""
    return isinstance(exc, (ConnectionRefusedError, socket.gaierror))


def public_url(base_url: str) -> str:
    """`base_url` without a user / password and without its query (where some keys travel)."""
    parts = urlsplit(base_url)
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def status_fault(base_url: str, path: str, status: int, message: str, model: str,
                 models: list[str] | None) -> str:
    """The job's stop reason for an HTTP `status` in JOB_STATUSES on `path`; `models`: the server's model ids
    (GET <base_url>/models), None when that failed too."""
    where = f"endpoint {public_url(base_url)}: HTTP {status} on POST {path}"
    said = f" ({message})" if message else ""
    if status in (401, 403):
        fix = "check engine.endpoint.api_key (or $OPENAI_API_KEY on the workers)"
    elif models is not None and model not in models:
        fix = f"engine.endpoint.model {model!r} is not served there; the server's models: " + \
            (", ".join(models[:20]) or "none")
    elif models is None:
        fix = "base_url usually ends in /v1 (e.g. http://host:8000/v1)"
    else:
        fix = "the server has the model but not this path: check engine.endpoint.base_url (usually ends in /v1)"
    return f"{where}{said}: {fix}"


def connection_fault(base_url: str, attempts: int, last_error: str) -> str:
    """The job's stop reason when nobody answered at `base_url` after every retry."""
    return (f"endpoint {public_url(base_url)}: no server answered after {attempts} attempts ({last_error}): "
            f"is it running, and are engine.endpoint.base_url's host and port right?")
