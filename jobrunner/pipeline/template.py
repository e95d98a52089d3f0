"""Prompt templates of a pipeline stage: `Q: {prompt}\nA: {generated_text}` over the previous stage's columns.

A placeholder is `{column}` (a dotted name such as `{generate.generated_text}` is the column of that name);
`{{` and `}}` are literal braces. Nothing else is interpreted (no format specs, no attribute access, no
expressions): a template is text and column names. A column that is null or absent in a row is that row's
error (TemplateError naming the column), never a crash and never the text "None".
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class TemplateSyntaxError(ValueError):
    """The template text is malformed (a lone brace, a placeholder that is not a column name)."""


class TemplateError(ValueError):
    """A row the template cannot be filled from (a null or missing column)."""


@dataclass(frozen=True)
class Template:
    """A parsed template: literal pieces and column names, alternating (`pieces[0] col[0] pieces[1] ...`)."""

    text: str
    pieces: tuple[str, ...]
    columns: tuple[str, ...]

    def render(self, row: dict[str, Any]) -> str:
        """The text for one row; TemplateError naming the first column that is null or absent."""
        out = [self.pieces[0]]
        for name, piece in zip(self.columns, self.pieces[1:], strict=True):
            if name not in row:
                raise TemplateError(f"template column {name!r} is missing")
            value = row[name]
            if value is None:
                raise TemplateError(f"template column {name!r} is null")
            out.append(value if isinstance(value, str) else _as_text(value))
            out.append(piece)
        return "".join(out)


def parse_template(text: str, where: str = "template") -> Template:
    """Parse a template; TemplateSyntaxError naming `where` (the spec field) and the bad part."""
    if not isinstance(text, str):
        raise TemplateSyntaxError(f"{where}: a template must be a string")
    pieces, columns, literal, pos = [], [], [], 0
    for match in _TOKEN.finditer(text):
        literal.append(text[pos:match.start()])
        pos = match.end()
        token = match.group(0)
        if token in ("{{", "}}"):
            literal.append(token[0])
            continue
        name = match.group(1)
        if name is None:
            raise TemplateSyntaxError(f"{where}: a lone {token!r} at character {match.start()}; write {token * 2} "
                                      "for a literal brace")
        name = name.strip()
        if not _NAME.fullmatch(name):
            raise TemplateSyntaxError(f"{where}: {{{name}}} is not a column name (write {{{{ and }}}} for "
                                      "literal braces)")
        pieces.append("".join(literal))
        literal = []
        columns.append(name)
    literal.append(text[pos:])
    pieces.append("".join(literal))
    return Template(text, tuple(pieces), tuple(columns))


def _as_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if isinstance(value, float) else str(value)
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)
