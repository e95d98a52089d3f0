"""Hiding secrets in what jobrunner writes down: manifests, error texts, output rows, Ray job submissions.

Two rules, applied everywhere (no dependencies, so spec, io and driver can all use it):

- a mapping key that looks like a credential (`key`, `secret`, `token`, `password`, `credential`,
  `authorization`, `connection_string`, `account_key`, `api_key`, `session`, `signature`, ...) has its value
  replaced by `***`, at every depth. Numbers, booleans and lists of numbers are kept: `stop_token_ids` is
  not a secret.
- free text (URLs, exception messages) has credentials cut out: `user:pass@` in URLs, `name=value` pairs
  whose name looks like a credential (query strings, connection strings), `Bearer <token>`.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"

# Whole key components (split on non-alphanumerics and camelCase) that mark a secret.
_SECRET_COMPONENTS = frozenset({
    "key", "keys", "secret", "secrets", "token", "password", "passwd", "pwd", "credential", "credentials",
    "authorization", "auth", "session", "signature", "sig", "sas", "cookie", "private", "bearer",
})
# Substrings of the squashed key (lowercase, alphanumerics only) that mark a secret.
_SECRET_SQUASHED = ("secret", "password", "passwd", "credential", "authorization", "connectionstring",
                    "apikey", "accountkey", "accesskey", "privatekey", "sastoken", "signature", "authtoken",
                    "sessiontoken")

_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<user>[^/@\s:?#]*):(?P<pw>[^/@\s?#]*)@")
_PAIR = re.compile(r"(?P<name>[A-Za-z][A-Za-z0-9_.\-]*)(?P<eq>\s*=\s*|:\s+)(?P<value>[^\s&;,'\"]+)")
_BEARER = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=\-]+", re.I)
_NOT_NAMES = ("Error", "Exception", "Warning")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def is_secret_key(key: Any) -> bool:
    """Whether a mapping key (or query / connection-string parameter name) names a credential."""
    text = _CAMEL.sub("_", str(key)).lower()
    if any(part in _SECRET_COMPONENTS for part in re.split(r"[^a-z0-9]+", text)):
        return True
    squashed = re.sub(r"[^a-z0-9]", "", text)
    return any(word in squashed for word in _SECRET_SQUASHED)


def _is_plain_number(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)


def redact(value: Any) -> Any:
    """A copy of `value` with secret-keyed values replaced and every string scrubbed (`redact_text`)."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_key(k) and not _is_plain_number(v) else redact(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_text(text: str) -> str:
    """`text` with URL passwords, secret-named `name=value` pairs and bearer tokens replaced by `***`."""
    if not text:
        return text
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{REDACTED}@", text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    return _PAIR.sub(_redact_pair, text)


def _redact_pair(m: re.Match) -> str:
    name, value = m["name"], m["value"]
    # `KeyError: x` is an exception name, `key=3` a count: neither is a credential.
    if not is_secret_key(name) or value == REDACTED or value.isdigit() or name.endswith(_NOT_NAMES):
        return m.group(0)
    return f"{m['name']}{m['eq']}{REDACTED}"


def find_secrets(value: Any, path: str = "") -> list[str]:
    """Dotted paths of literal secrets in a plain structure (what `redact` would hide).

    A value written as an environment reference (`${env:NAME}`, see jobrunner.spec) is not a literal secret.
    """
    if isinstance(value, dict):
        found = []
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if is_secret_key(k) and not _is_plain_number(v):
                found += [where] if _has_literal(v) else []
            else:
                found += find_secrets(v, where)
        return found
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in find_secrets(v, f"{path}[{i}]")]
    if isinstance(value, str):
        masked = ENV_REF.sub(REDACTED, value)
        return [path] if redact_text(masked) != masked else []
    return []


ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")  # ${env:NAME}, resolved where the spec is loaded


def _has_literal(value: Any) -> bool:
    """Whether a value under a secret key holds a written-out secret (not only ${env:NAME} references)."""
    if isinstance(value, dict):
        return any(_has_literal(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_literal(v) for v in value)
    if isinstance(value, str):
        return bool(value.strip()) and not ENV_REF.search(value)
    return not _is_plain_number(value)
