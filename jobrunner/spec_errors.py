"""Job-spec error messages that help: which field, which `--set` set it, and "did you mean" for a misspelt key."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """'; did you mean 'x'?' for the closest choice, '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not close and len(word) >= 3:  # a prefix of a longer name ("max_tok") is worth suggesting too
        close = [c for c in choices if c.startswith(word) or word.startswith(c)][:1]
    return f"; did you mean {close[0]!r}?" if close else ""


def describe_spec_errors(model: type[BaseModel], exc: ValidationError, source: str,
                         overrides: Sequence[str] = ()) -> str:
    """The message of a SpecError: a header naming where the values came from, one line per bad field.

    model: the spec model `exc` came from (its field names feed "did you mean"); taken as an argument so this
    module needs nothing from spec.py, which imports it.
    """
    set_paths = [(pair, tuple(pair.partition("=")[0].strip().split("."))) for pair in overrides]
    lines, from_set = [], []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        pair = _override_for(loc, set_paths)
        message = _message(model, err, loc)
        text = f"{'.'.join(loc)}: {message}" if loc else message  # a spec-wide check's text names its fields
        lines.append(f"  --set {pair}: {text}" if pair else f"  {text}")
        from_set.append(pair is not None)
    if all(from_set):
        header = f"invalid --set for {source}:"
    elif any(from_set):
        header = f"{source} with --set: invalid job spec:"
    else:
        header = f"{source}: invalid job spec:"
    return "\n".join([header, *lines])


def _override_for(loc: tuple[str, ...], set_paths: list[tuple[str, tuple[str, ...]]]) -> str | None:
    """The last `--set` whose key is the field or one of its sections (the last one wins in the merge)."""
    found = None
    for pair, path in set_paths:
        if loc[:len(path)] == path:
            found = pair
    return found


def _message(model: type[BaseModel], err: dict[str, Any], loc: tuple[str, ...]) -> str:
    if err["type"] == "value_error":  # our own validators' text names the field already
        return str(err.get("ctx", {}).get("error") or err["msg"])
    if err["type"] in ("model_type", "model_attributes_type", "dict_type"):
        shape = _section_shape(model, loc, err.get("input"))
        if shape:
            return shape
    if err["type"] != "extra_forbidden":
        return str(err["msg"])
    known = _known_keys(model, loc[:-1])
    if known is None:
        return "unknown field (not allowed)"
    elsewhere = _sections_with(model, loc[-1], loc[:-1])
    if elsewhere:
        here = ".".join(loc[:-1]) or "the top level"
        where = " or ".join(w or "the top level" for w in elsewhere)
        path = ".".join(filter(None, (elsewhere[0], loc[-1])))
        return f"unknown field in {here}; it belongs in {where}: write {path}"
    hint = did_you_mean(loc[-1], known)
    return "unknown field (not allowed)" + (hint or f"; known: {', '.join(known)}")


def _section_shape(model: Any, loc: tuple[str, ...], given: Any) -> str | None:
    """'expected a section like `model: {source: x}`, got the string x' for a scalar (or list) where a section
    (a pydantic model) is expected; None when ``loc`` is not a section."""
    section = _section_model(model, loc)
    if section is None or not loc or isinstance(given, dict):
        return None
    first = next(iter(section.model_fields))
    value = given if isinstance(given, (str, int, float)) and not isinstance(given, bool) else "..."
    return (f"expected a section (a mapping) like `{loc[-1]}: {{{first}: {value}}}`, got "
            f"{type(given).__name__} {given!r}")


def _section_model(model: Any, loc: tuple[str, ...]) -> Any:
    """The pydantic model of the section at ``loc`` (None when it is not one)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field is not None else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _sections_with(model: Any, key: str, exclude: tuple[str, ...], path: tuple[str, ...] = ()) -> list[str]:
    """Dotted paths of the sections of ``model`` (at any depth) that have a field ``key``, except ``exclude``."""
    found = []
    if path != exclude and key in model.model_fields:
        found.append(".".join(path))
    for name, field in model.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            found += _sections_with(sub, key, exclude, (*path, name))
    return found


def _known_keys(model: Any, section: tuple[str, ...]) -> list[str] | None:
    """The field names of the section of `model` at `section` (None when it is not a pydantic model)."""
    for part in section:
        field = model.model_fields.get(part)
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return list(model.model_fields)
