"""Hiding secrets in what jobrunner writes down or shows: manifests, commit records, reports, output rows, logs,
error messages, Ray job submissions. The one module every boundary uses (no dependencies, so spec, models, io,
driver, reports and cli can all import it).

Rules:

- a mapping key names a credential when, read case- and separator-insensitively (`HUB_PASS`, `hub-pass`,
  `hubPass` and `Hub.Pass` are one name; camelCase splits into words):
  - one of its words is a credential word: `pass`, `password`, `passwd`, `pwd`, `passphrase`, `secret`,
    `token`, `key`, `credential(s)`, `creds`, `auth`, `authorization`, `dsn`, `session`, `signature`, `sig`,
    `sas`, `cookie`, `private`, `bearer`, ... (`hub_pass`, `api_key`, `access_token`, `sentry_dsn`);
  - or, written as one word, it contains `secret`, `password`, `passwd`, `passphrase`, `credential`,
    `apikey`, `accesskey`, ... or ends in `token` / `dsn` (`accesstoken`, `apitoken`, `hftoken`, `sentrydsn`);
  - but not a tokenizer name (`eos_token`, `stop_token_ids`, `token_ids`): a vocabulary entry. Counts are
    never words of the list: `max_tokens`, `num_tokens`, `passes`, `num_passes`, `bypass` are no credentials.
  Its value is replaced by `***`, at every depth. Numbers, booleans and lists of numbers are kept:
  `stop_token_ids` is not a secret, and neither is a count under any name.
- a mapping key is itself scrubbed like free text (a secret that YAML parsed into a key, a URL with a
  password used as a key); keys that become equal are told apart (`***`, `*** #2`).
- in free text (URLs, exception messages, error kinds):
  - a URL keeps its scheme, host and path; its userinfo goes (`https://***@host/...`) when it holds a password
    or looks like a token, and so does every query value whose name looks like a credential
    (`X-Amz-Signature`, `sig`, `X-Goog-Credential`, `token`, ...) or whose value looks like one (long, random);
  - `name=value`, `name: value` and quoted pairs (`{"api_key": "..."}`, `'token': '...'`, `password="..."`)
    whose name looks like a credential lose their value;
  - `Bearer <token>` / `Basic <token>` and well-known token shapes (`hf_...`, `sk-...`, `ghp_...`, `AKIA...`,
    JWTs) are cut wherever they appear.

What a person reads goes through one path, `redact_text`, from three doors: `say` for the driver's lines
(stages, progress, notices), `redacting_logger` for log records of driver/, io/, cli/ and reports/ (message,
arguments and traceback), and cli/echo.py for what a command prints (click's own error messages included).
tests/test_redaction.py checks that no other door (a bare print, click.echo, logging.getLogger) is used there.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import threading
from collections.abc import Iterable
from typing import Any, TextIO

REDACTED = "***"

# Whole key components (split on non-alphanumerics and camelCase) that mark a secret.
_SECRET_COMPONENTS = frozenset({
    "key", "keys", "secret", "secrets", "token", "pass", "password", "passwords", "passwd", "pwd", "passphrase",
    "credential", "credentials", "creds", "authorization", "auth", "dsn", "session", "signature", "sig", "sas",
    "cookie", "private", "bearer", "pw", "pat", "passcode", "passkey", "otp",
})
# Substrings of the squashed key (lowercase, alphanumerics only) that mark a secret.
_SECRET_SQUASHED = ("secret", "password", "passwd", "passphrase", "passcode", "credential", "authorization",
                    "connectionstring", "connstr", "apikey", "accountkey", "accesskey", "privatekey", "signature")
# Endings of the squashed key that mark a secret written as one word (`accesstoken`, `apitoken`, `sentrydsn`);
# a plural is a count (`maxtokens`).
_SECRET_ENDINGS = ("token", "dsn")
# Names that contain `token` but name a vocabulary entry, not a credential (`eos_token`, `stop_token_ids`).
_TOKENIZER_NAMES = re.compile(r"^(?:eos|bos|pad|unk|sep|cls|mask|stop|start|end)_token(?:_ids?)?$|^token_ids?$")

# A URL ends before whitespace, quotes and trailing punctuation ("cannot read URL: 403").
_URL = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>(?:[^\s'\"<>`\\]*[^\s'\"<>`\\.,;:!?)\]}])?)")
# `"name": "value"`, `'name': 'value'`, `name="value"`; a value left open (a quoted line cut short) runs to the
# end of the line.
_QUOTED_PAIR = re.compile(
    r"(?P<q1>\\?[\"']|)(?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)(?P=q1)(?P<eq>\s*[:=]\s*)"
    r"(?P<q2>\\?[\"'])(?P<value>(?:\\.|[^\\\n])*?)(?P<close>(?P=q2)|(?=\n)|\Z)")
# `name: value` needs the space: `module:function` (engine.factory) and `scheme:path` are no pairs.
_PAIR = re.compile(r"(?<![A-Za-z0-9_.\-])(?P<name>[A-Za-z][A-Za-z0-9_.\-]*)(?P<eq>\s*=\s*|:\s+)"
                   r"(?P<value>[^\s&;,'\"]+)")
# `name: value` whose name ends like a file (`session_notes.txt: cannot read`) or sits in a path
# (`jobs/key_typo.yaml: ...`) is a message about that file, not a credential.
_FILE_NAME = re.compile(r"\.(?:ya?ml|json|jsonl|parquet|csv|tsv|txt|md|py|toml|ini|cfg|conf|log|gguf|safetensors"
                        r"|bin|pt|arrow|gz|zst|bz2|xz|zip|tar|sh|html|pem|crt|cert)$", re.I)
_BEARER = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=\-]+", re.I)
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-(?:proj-|ant-)?[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|github_pat_[A-Za-z0-9_]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abposr]-[A-Za-z0-9\-]{10,}"
    r"|AIza[0-9A-Za-z_\-]{30,}|eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,})")
_RANDOM_LOOKING = re.compile(r"^[A-Za-z0-9+/=_\-.~%]{24,}$")
# A count or a ratio (`secret-adv: 3/6 shards committed`, `key=3`): no credential under any name.
_COUNT = re.compile(r"\d[\d.,/%]*")
_NOT_NAMES = ("Error", "Exception", "Warning")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def is_secret_key(key: Any) -> bool:
    """Whether a mapping key (or query / connection-string parameter name) names a credential."""
    text = _CAMEL.sub("_", str(key)).lower()
    parts = [p for p in re.split(r"[^a-z0-9]+", text) if p]
    if _TOKENIZER_NAMES.match("_".join(parts)):
        return False
    if any(part in _SECRET_COMPONENTS for part in parts):
        return True
    squashed = "".join(parts)
    return any(word in squashed for word in _SECRET_SQUASHED) or squashed.endswith(_SECRET_ENDINGS)


def looks_random(value: str) -> bool:
    """Whether a value looks like a generated credential: long, URL-safe, letters and digits, many distinct
    characters (a signature, a token), as opposed to a date, a number or a word."""
    return (bool(_RANDOM_LOOKING.match(value)) and any(c.isdigit() for c in value)
            and any(c.isalpha() for c in value) and len(set(value)) >= 14)


def _is_plain_number(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)


def redact(value: Any) -> Any:
    """A copy of `value` with secret-keyed values replaced and every string, keys included, scrubbed
    (`redact_text`)."""
    if isinstance(value, dict):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            out[_unique_key(_redact_key(k), out)] = REDACTED if is_secret_key(k) and not _is_plain_number(v) \
                else redact(v)
        return out
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def _redact_key(key: Any) -> Any:
    return redact_text(key) if isinstance(key, str) else key


def _unique_key(key: Any, taken: dict[Any, Any]) -> Any:
    """`key`, or `key #2`, `key #3`, ... when two keys redact to one (`{hf_a..: 1, hf_b..: 2}`)."""
    if key not in taken:
        return key
    n = 2
    while f"{key} #{n}" in taken:
        n += 1
    return f"{key} #{n}"


def redact_text(text: str) -> str:
    """`text` with URL credentials, secret-named pairs, bearer tokens and token-shaped strings replaced by `***`."""
    if not text:
        return text
    return _redact_by_rules(_KNOWN.scrub(text))


def _redact_by_rules(text: str) -> str:
    """`text` redacted by name and shape alone (no known values)."""
    text = _URL.sub(_redact_url_match, text)
    text = _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
    text = _TOKEN_SHAPES.sub(REDACTED, text)
    text = _QUOTED_PAIR.sub(_redact_quoted_pair, text)
    return _redact_pairs(text)


def redact_url(url: str) -> str:
    """`redact_text` of one URL, cached: shards of one input file share its URL."""
    return _redact_url_cached(url, _KNOWN.generation)


@functools.lru_cache(maxsize=4096)
def _redact_url_cached(url: str, generation: int) -> str:  # generation: a new known secret is a new key
    return redact_text(url)


def redact_counts(kind_to_count: dict[str, int]) -> dict[str, int]:
    """A count table (error kind -> rows) with its keys redacted; kinds that become equal are summed."""
    out: dict[str, int] = {}
    for kind, count in kind_to_count.items():
        key = redact_text(str(kind))
        out[key] = out.get(key, 0) + count
    return out


def _redact_url_match(m: re.Match) -> str:
    rest = m["rest"]
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, has_password, password = userinfo.partition(":")
        token_like = looks_random(user) or bool(_TOKEN_SHAPES.search(user))
        # `user:***@` is already redacted (an ${env:NAME} password masked by find_secrets, or redacted before)
        if token_like or (has_password and password != REDACTED):
            authority = f"{REDACTED}@{host}"
    if "?" in tail:
        path, query = tail.split("?", 1)
        query, hash_sep, fragment = query.partition("#")
        tail = f"{path}?{re.sub(r'[^&;]+', _redact_query_param, query)}{hash_sep}{fragment}"
    return f"{m['scheme']}{authority}{tail}"


def _redact_query_param(m: re.Match) -> str:
    name, eq, value = m.group(0).partition("=")
    if eq and value and value != REDACTED and (is_secret_key(name) or looks_random(value)):
        return f"{name}={REDACTED}"
    return m.group(0)


def _redact_quoted_pair(m: re.Match) -> str:
    name, value = m["name"], m["value"]
    head = f"{m['q1']}{name}{m['q1']}{m['eq']}{m['q2']}"
    if not is_secret_key(name) or name.endswith(_NOT_NAMES):  # a pair may sit inside the value
        return f"{head}{_QUOTED_PAIR.sub(_redact_quoted_pair, value)}{m['close']}"
    return f"{head}{value if value == REDACTED else REDACTED}{m['close']}"


def _names_a_file(m: re.Match) -> bool:
    """A `name: value` pair whose name is a file name or the last piece of a path."""
    if ":" not in m["eq"]:
        return False
    before = m.string[m.start() - 1] if m.start() else ""
    return before in ("/", "\\") or bool(_FILE_NAME.search(m["name"]))


def _redact_pairs(text: str) -> str:
    """Every `name=value` / `name: value` with a credential name loses its value. A pair that is no credential
    (`Error: ...`, a count, a file name) is kept, and its value is scanned again from its start, so a pair that
    follows it (`jobs/key_typo.yaml: api_key: ...`, `config=api_key=...`) is seen too."""
    out, pos = [], 0
    while (m := _PAIR.search(text, pos)) is not None:
        out.append(text[pos:m.start()])
        name, value = m["name"], m["value"]
        # `KeyError: x` is an exception name, `key=3` a count: neither is a credential
        if not is_secret_key(name) or name.endswith(_NOT_NAMES) or _names_a_file(m):
            out.append(text[m.start():m.start("value")])
            pos = m.start("value")
            continue
        keep = value.startswith(REDACTED) or _COUNT.fullmatch(value) is not None
        out.append(m.group(0) if keep else f"{name}{m['eq']}{REDACTED}")
        pos = m.end()
    out.append(text[pos:])
    return "".join(out)


def find_secrets(value: Any, path: str = "") -> list[str]:
    """Dotted paths of literal secrets in a plain structure (what `redact` would hide).

    A value written as an environment reference (`${env:NAME}`, see jobrunner.spec) is not a literal secret.
    """
    if isinstance(value, dict):
        found = []
        for k, v in value.items():
            where = f"{path}.{_redact_key(k)}" if path else str(_redact_key(k))
            if isinstance(k, str) and _redact_key(ENV_REF.sub(REDACTED, k)) != ENV_REF.sub(REDACTED, k):
                found.append(f"{where} (a key)")
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


# ---- secrets by value ------------------------------------------------------------------------------------
MIN_SECRET_CHARS = 6  # a shorter value would cut ordinary words and numbers out of every text


class KnownSecrets:
    """The secret values this process knows (what the spec resolved: `${env:NAME}` values, credential-named
    options, credential-looking values), cut from every text by value, whatever its shape or the name beside
    it: an engine's `login refused for <key>` holds no name to go by. Values are only ever added (a process
    runs one job; a worker gets the driver's values with its spec, `remember_secrets`); each is also known in
    its URL-quoted and JSON-escaped forms."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: set[str] = set()
        self._pattern: re.Pattern[str] | None = None
        self.generation = 0  # bumped on every change (redact_url's cache key)

    def add(self, values: Iterable[str]) -> None:
        """Know these values (and their quoted / escaped forms) from now on."""
        new = {form for v in values if isinstance(v, str) for form in _forms(v)} - self._values
        if not new:
            return
        with self._lock:
            self._values |= new
            # longest first: a value that contains another is cut whole
            ordered = sorted(self._values, key=lambda v: (-len(v), v))
            self._pattern = re.compile("|".join(re.escape(v) for v in ordered))
            self.generation += 1

    def values(self) -> list[str]:
        """The known values, sorted (what a worker is given)."""
        return sorted(self._values)

    def scrub(self, text: str) -> str:
        """`text` with every known value replaced by `***`."""
        pattern = self._pattern
        return pattern.sub(REDACTED, text) if pattern is not None else text


def _forms(value: str) -> set[str]:
    """A secret as text may carry it: as is, URL-quoted (a password in a URL), JSON-escaped."""
    import json
    from urllib.parse import quote, quote_plus

    value = value.strip()
    if len(value) < MIN_SECRET_CHARS or REDACTED in value:
        return set()
    forms = {value, quote(value, safe=""), quote_plus(value), json.dumps(value)[1:-1]}
    return {f for f in forms if len(f) >= MIN_SECRET_CHARS}


_KNOWN = KnownSecrets()


def remember_secrets(values: Iterable[str]) -> None:
    """Cut these values from every text this process redacts from now on (`redact_text` and all above it)."""
    _KNOWN.add(values)


def known_secret_values() -> list[str]:
    """Every secret value this process knows: what the driver hands its workers."""
    return _KNOWN.values()


def secret_values(value: Any, env_values: Iterable[str] = ()) -> set[str]:
    """The secret values a plain structure (a spec as a dict) holds, to be cut by value wherever they show up:
    `env_values` (what its `${env:NAME}` references resolved to), every string under a credential-named key,
    and every piece that `redact_text` cuts from a string (a URL's password, a token, a connection string's
    `Pwd=`). Values shorter than MIN_SECRET_CHARS are left to the rules by name and shape, and so are plain
    lowercase words under a credential name (`key: testing`): cutting `default` from every text would hide
    more than it protects."""
    found = {v for v in env_values if isinstance(v, str)}
    found |= {v for v in _secret_leaves(value, False) if _is_worth_knowing(v)}
    return {v.strip() for v in found if len(v.strip()) >= MIN_SECRET_CHARS and REDACTED not in v}


def _secret_leaves(value: Any, under_secret: bool) -> Iterable[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield from _cut_pieces(k)
            yield from _secret_leaves(v, under_secret or (is_secret_key(k) and not _is_plain_number(v)))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _secret_leaves(v, under_secret)
    elif isinstance(value, str):
        if under_secret:
            yield value
        yield from _cut_pieces(value)


def _cut_pieces(text: str) -> list[str]:
    """The pieces of `text` that the rules by name and shape replace (what `redact_text` removes)."""
    import difflib

    if not text:
        return []
    redacted = _redact_by_rules(text)
    if redacted == text:
        return []
    ops = difflib.SequenceMatcher(None, text, redacted, autojunk=False).get_opcodes()
    pieces = [text[i1:i2] for tag, i1, i2, _, _ in ops if tag in ("replace", "delete")]
    return pieces + [p.split(":", 1)[1] for p in pieces if ":" in p]  # a URL's `user:password`: the password


def _is_worth_knowing(value: str) -> bool:
    """A value to cut by value: not a plain lowercase word or a number (those stay to the name rules)."""
    value = value.strip()
    if value.isdigit() or value.lower() in ("true", "false", "none", "null"):
        return False
    plain_word = value.isalpha() and (value.islower() or value.isupper())
    return not plain_word or len(value) >= 12


def _has_literal(value: Any) -> bool:
    """Whether a value under a secret key holds a written-out secret (not only ${env:NAME} references)."""
    if isinstance(value, dict):
        return any(_has_literal(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_literal(v) for v in value)
    if isinstance(value, str):
        return bool(value.strip()) and not ENV_REF.search(value)
    return not _is_plain_number(value)


# ---- the doors -----------------------------------------------------------------------------------------
def say(text: str, file: TextIO | None = None) -> None:
    """Print one line for a person (stderr unless `file`), redacted."""
    print(redact_text(str(text)), file=file or sys.stderr, flush=True)


class RedactingFilter(logging.Filter):
    """Scrubs a log record before any handler sees it: the formatted message (arguments merged in, so a URL
    passed as `%s` is scrubbed too) and the traceback text."""

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        try:
            record.msg, record.args = redact_text(record.getMessage()), None
        except Exception:  # noqa: BLE001 - a bad format string: keep the template, drop the arguments
            record.msg, record.args = redact_text(str(record.msg)), None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def redacting_logger(name: str) -> logging.Logger:
    """`logging.getLogger(name)` whose records are scrubbed (`RedactingFilter`); a filter acts on the records
    of its own logger only, so each module of driver/, io/, cli/ and reports/ takes its logger here."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())
    return logger


def env_ref_values(value: Any) -> list[str]:
    """What every `${env:NAME}` in a plain structure's strings stands for in this process (unset ones left
    out: resolving them fails, naming the field)."""
    import os

    if isinstance(value, dict):
        return [v for item in value.values() for v in env_ref_values(item)]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in env_ref_values(item)]
    if isinstance(value, str):
        return [os.environ[name] for name in ENV_REF.findall(value) if name in os.environ]
    return []
