"""Filter expressions of a pipeline stage: `json_valid and score >= 7`, parsed once, evaluated per row.

Python's `ast` parses the text (mode "eval"); every node must be of a whitelisted type, checked when the
filter is compiled, and our own walker evaluates the tree against a row (a dict of columns). Nothing of the
user's text ever reaches `eval` or `compile`-to-bytecode: names are columns (a dotted name `generate.score` is
the column of that name), literals are numbers, strings, lists / tuples of them, `true` / `false` / `null`
(also `True` / `False` / `None`). Semantics are SQL-like where a value is null: an order comparison (`<`, `>=`
...) with null is false; `==` / `!=` / `is` compare with null as a value; `and` / `or` / `not` take Python
truth. A type error inside one row (a string compared with a number) is a `FilterError` naming the column and
the row: the caller drops that row and counts it.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CONSTANT_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
_ORDER = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}
_EQUALITY = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.Mod: operator.mod}
_ALLOWED = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub, ast.UAdd, ast.Compare,
            ast.BinOp, ast.Name, ast.Attribute, ast.Constant, ast.List, ast.Tuple, ast.Load, ast.In, ast.NotIn,
            *_ORDER, *_EQUALITY, *_ARITH)
MAX_CHARS = 2000


class FilterSyntaxError(ValueError):
    """The filter text is not an expression we evaluate (names the offending part)."""


class FilterError(ValueError):
    """A row the filter cannot decide (a type error); names the column(s) and the row."""


@dataclass(frozen=True)
class Filter:
    """A compiled filter: `columns` are the names it reads (for validate's schema check)."""

    text: str
    tree: ast.Expression
    columns: tuple[str, ...] = field(default=())

    def keeps(self, row: dict[str, Any], row_id: str = "?") -> bool:
        """Whether the row passes; FilterError for a row it cannot decide (naming the columns and the row id)."""
        try:
            return bool(_eval(self.tree.body, row))
        except _RowTypeError as exc:
            raise FilterError(f"filter {self.text!r}: row {row_id}: {exc}") from None


class _RowTypeError(Exception):
    pass


def parse_filter(text: str) -> Filter:
    """Compile a filter; FilterSyntaxError in one line naming what is not allowed."""
    if not isinstance(text, str) or not text.strip():
        raise FilterSyntaxError("filter: an empty expression")
    if len(text) > MAX_CHARS:
        raise FilterSyntaxError(f"filter: longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        raise FilterSyntaxError(f"filter {text!r}: not an expression ({exc.msg} at column {exc.offset})") from None
    columns: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise FilterSyntaxError(f"filter {text!r}: {type(node).__name__} is not allowed (columns, numbers, "
                                    "strings, lists, comparisons, in, and / or / not, + - * / %)")
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool, type(None))):
            raise FilterSyntaxError(f"filter {text!r}: the literal {node.value!r} is not allowed")
    _collect_columns(tree.body, columns)
    return Filter(text, tree, tuple(dict.fromkeys(columns)))


def column_name(node: ast.AST) -> str | None:
    """`score` -> 'score'; `generate.generated_text` -> 'generate.generated_text'; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = column_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _collect_columns(node: ast.AST, out: list[str]) -> None:
    name = column_name(node)
    if name is not None:
        if name not in CONSTANT_NAMES:
            out.append(name)
        return
    if isinstance(node, ast.Attribute):
        raise FilterSyntaxError(f"filter: {ast.unparse(node)!r} is not a column name")
    for child in ast.iter_child_nodes(node):
        _collect_columns(child, out)


def _eval(node: ast.AST, row: dict[str, Any]) -> Any:
    handler = _HANDLERS.get(type(node))
    if handler is not None:
        return handler(node, row)
    name = column_name(node)
    if name is None:  # parse_filter let only whitelisted nodes through
        raise _RowTypeError(f"cannot evaluate {ast.unparse(node)!r}")
    if name in CONSTANT_NAMES and name not in row:
        return CONSTANT_NAMES[name]
    return row.get(name)


def _bool_op(node: ast.BoolOp, row: dict[str, Any]) -> Any:
    if isinstance(node.op, ast.And):
        return all(_eval(v, row) for v in node.values)
    return any(_eval(v, row) for v in node.values)


def _unary(node: ast.UnaryOp, row: dict[str, Any]) -> Any:
    value = _eval(node.operand, row)
    if isinstance(node.op, ast.Not):
        return not value
    if value is None:
        return None
    _need_number(value, node.operand)
    return -value if isinstance(node.op, ast.USub) else value


def _compare(node: ast.Compare, row: dict[str, Any]) -> bool:
    left_node, left = node.left, _eval(node.left, row)
    for op, right_node in zip(node.ops, node.comparators, strict=True):
        right = _eval(right_node, row)
        if not _compare_one(op, left, right, left_node, right_node):
            return False
        left_node, left = right_node, right
    return True


def _compare_one(op: ast.cmpop, left: Any, right: Any, left_node: ast.AST, right_node: ast.AST) -> bool:
    if type(op) in _EQUALITY:
        if isinstance(op, (ast.Is, ast.IsNot)):  # `x is None`: identity against a constant only
            return (left is None) == (right is None) if isinstance(op, ast.Is) else (left is None) != (right is None)
        return bool(_EQUALITY[type(op)](left, right))
    if isinstance(op, (ast.In, ast.NotIn)):
        if right is None:
            return False
        if not isinstance(right, (list, tuple, str)):
            raise _RowTypeError(f"{_describe(right_node)} is {_kind(right)}, not a list or string, for 'in'")
        if isinstance(right, str) and not isinstance(left, str):
            raise _RowTypeError(f"{_describe(left_node)} is {_kind(left)}: 'in' a string needs a string")
        found = left in right
        return found if isinstance(op, ast.In) else not found
    if left is None or right is None:  # an order comparison with null is false
        return False
    if _is_number(left) != _is_number(right) or (not _is_number(left) and type(left) is not type(right)):
        raise _RowTypeError(f"cannot compare {_describe(left_node)} ({_kind(left)}) with "
                            f"{_describe(right_node)} ({_kind(right)})")
    return bool(_ORDER[type(op)](left, right))


def _bin_op(node: ast.BinOp, row: dict[str, Any]) -> Any:
    left, right = _eval(node.left, row), _eval(node.right, row)
    if left is None or right is None:
        return None
    if isinstance(node.op, ast.Add) and isinstance(left, str) and isinstance(right, str):
        return left + right
    _need_number(left, node.left)
    _need_number(right, node.right)
    if isinstance(node.op, (ast.Div, ast.Mod)) and right == 0:
        return None
    return _ARITH[type(node.op)](left, right)


def _sequence(node: ast.List | ast.Tuple, row: dict[str, Any]) -> list[Any]:
    return [_eval(e, row) for e in node.elts]


_HANDLERS: dict[type, Callable[[Any, dict[str, Any]], Any]] = {
    ast.BoolOp: _bool_op, ast.UnaryOp: _unary, ast.Compare: _compare, ast.BinOp: _bin_op,
    ast.Constant: lambda node, row: node.value, ast.List: _sequence, ast.Tuple: _sequence,
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _need_number(value: Any, node: ast.AST) -> None:
    if not _is_number(value):
        raise _RowTypeError(f"{_describe(node)} is {_kind(value)}, not a number")


def _describe(node: ast.AST) -> str:
    name = column_name(node)
    return f"column {name!r}" if name is not None and name not in CONSTANT_NAMES else ast.unparse(node)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"{type(value).__name__} {value!r}"[:60]
