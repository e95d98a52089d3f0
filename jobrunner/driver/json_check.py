"""Is a generated text valid JSON for the row's schema? The per-row ``json_valid`` output column.

Constrained decoding keeps every token inside the schema's grammar, but a row cut by ``max_tokens`` ends
mid-value: such text is not JSON at all. ``json_valid`` makes that visible per row (true, false; null for rows
without a schema and error rows). The check parses the text and validates it with ``jsonschema`` (part of the
``structured`` extra that schema rows need anyway); each distinct schema is compiled once per worker.
"""

from __future__ import annotations

import json
from typing import Any

from jobrunner.redaction import redacting_logger

log = redacting_logger(__name__)
_VALIDATORS: dict[str, Any] = {}  # the schema's canonical JSON -> its compiled validator (None: no jsonschema)
_MAX_VALIDATORS = 256


def json_valid(text: str | None, schema: dict[str, Any] | None) -> bool | None:
    """Whether ``text`` parses as JSON and satisfies ``schema``; None when there is no schema or no text, or
    when ``jsonschema`` is not installed (then a warning says so once)."""
    if schema is None or text is None:
        return None
    validator = _validator(schema)
    if validator is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        return bool(validator.is_valid(value))
    except Exception as exc:  # noqa: BLE001 - a schema jsonschema cannot follow (e.g. an unresolvable $ref)
        log.warning("json_valid left empty for a row: its schema cannot be checked (%s)", exc)
        return None


def _validator(schema: dict[str, Any]) -> Any:
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        if len(_VALIDATORS) >= _MAX_VALIDATORS:  # per-row schemas: keep the cache bounded
            _VALIDATORS.clear()
        _VALIDATORS[key] = _compile(schema)
    return _VALIDATORS[key]


def _compile(schema: dict[str, Any]) -> Any:
    try:
        import jsonschema
    except ImportError:
        log.warning("json_valid left empty: the jsonschema package is not installed "
                    "(pip install 'jobrunner[structured]')")
        return None
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)
