"""The ctypes ``argtypes`` / ``restype`` of every native entry point, read from the one place they are written:
the prototypes in ``csrc/include/jr_kernels.h`` (which every kernel source includes, so the compiler holds each
definition to it).

:data:`SIGNATURES` maps library -> function -> ``(restype, argtypes)``; :func:`declare` sets them on a loaded
library (``jobrunner.kernels.build.load`` calls it). The header's types are few: ``void``, ``int``,
``int64_t``, ``float``, ``double`` and pointers: ``c_void_p`` for every tensor (the callers pass
``data_ptr()``), ``double *`` for the layer loop's timings, and the layer loop's structs, mirrored here as
ctypes structures (their sizes are checked against C's, ``jr_loop_struct_sizes``, in the tests).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

HEADER = Path(__file__).parent / "csrc" / "include" / "jr_kernels.h"
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class LoopModel(ctypes.Structure):
    """``JrLoopModel``: the layer loop's kernels (function addresses) and shapes."""

    _fields_ = [(name, _P) for name in ("norm", "rotary", "silu", "write_kv", "decode", "native", "chunk")] + [
        (name, _I) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "layers")] + [
        ("eps", _F), ("scale", _F)]


class LoopLayer(ctypes.Structure):
    """``JrLoopLayer``: one layer's packed weights (each with its linear kernel), norms and KV cache views."""

    _fields_ = [(name, _P) for name in ("in_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down",
                                        "qkv_fn", "o_fn", "gate_up_fn", "down_fn", "k_cache", "v_cache")]


class LoopRows(ctypes.Structure):
    """``JrLoopRows``: the rows of one attention kernel in a step."""

    _fields_ = [(name, _I) for name in ("num_rows", "max_blocks", "num_groups")] + [
        (name, _P) for name in ("start", "len", "seq", "tables", "group_off", "group_rows", "group_len", "key_start")]


class LoopStep(ctypes.Structure):
    """``JrLoopStep``: one step's rows, buffers, rotary tables, slots and attention rows."""

    _fields_ = [("rows", _I), ("threads", _I)] + [
        (name, _P) for name in ("x", "x0", "x1", "h", "qkv", "q", "attn", "o", "gate_up", "act", "down", "out",
                                "cos", "sin", "slots")] + [
        ("block_size", _I), ("fast_min_query", _I), ("decodes", LoopRows), ("natives", LoopRows),
        ("chunks", LoopRows), ("workspace", _P), ("final_norm", _P)]


class Int4Linear(ctypes.Structure):
    """``JrInt4Linear``: an int4 layer for ``jr_i4_linear`` (its blocks, expansion, scratch and trailer)."""

    _fields_ = [(name, _P) for name in ("expand", "packed", "pairs", "inv", "trailer", "wt", "tiles")] + [
        (name, _I) for name in ("block_n", "split", "group", "pair_stride")]


STRUCTS = {"JrInt4Linear": Int4Linear, "JrLoopModel": LoopModel, "JrLoopLayer": LoopLayer, "JrLoopRows": LoopRows,
           "JrLoopStep": LoopStep}
_SCALARS = {"void": None, "int": ctypes.c_int, "int64_t": _I, "float": _F, "double": ctypes.c_double}
_POINTEES = {"double": ctypes.c_double}  # the layer loop's timings (every other pointer: a tensor's data_ptr())
_LIBRARY = re.compile(r"/\* library (\w+):")
_PROTOTYPE = re.compile(r"^(int|int64_t|void) (jr_\w+)\(([^;]*)\);", re.MULTILINE)

Signature = tuple[type | None, list[type]]


def _ctype(declaration: str) -> type | None:
    """The ctypes type of a C type (a parameter's declaration without its name, or a return type)."""
    text = declaration.replace("const ", "").strip()
    if "*" in text:
        pointee = text.replace("*", "").strip()
        if pointee in STRUCTS:
            return ctypes.POINTER(STRUCTS[pointee])
        return ctypes.POINTER(_POINTEES[pointee]) if pointee in _POINTEES else _P
    if text not in _SCALARS:
        raise ValueError(f"{HEADER.name}: no ctypes type for C type {declaration.strip()!r}")
    return _SCALARS[text]


def _parameter_type(parameter: str) -> type | None:
    """``const int64_t *seq`` -> the ctypes type of ``const int64_t *`` (the name dropped)."""
    text = " ".join(parameter.split())
    name_at = max(text.rfind(" "), text.rfind("*"))
    return _ctype(text[:name_at + 1])


def parse_header(text: str) -> dict[str, dict[str, Signature]]:
    """library -> function -> (restype, argtypes), from the prototypes of ``jr_kernels.h``."""
    marks = [(m.start(), m.group(1)) for m in _LIBRARY.finditer(text)]
    out: dict[str, dict[str, Signature]] = {name: {} for _, name in marks}
    for m in _PROTOTYPE.finditer(text):
        library = [name for at, name in marks if at < m.start()][-1]
        params = [p for p in (part.strip() for part in m.group(3).split(",")) if p and p != "void"]
        out[library][m.group(2)] = (_ctype(m.group(1)), [_parameter_type(p) for p in params])
    return out


SIGNATURES: dict[str, dict[str, Signature]] = parse_header(HEADER.read_text(encoding="utf-8"))


def declare(lib: ctypes.CDLL, library: str) -> None:
    """Set ``restype`` / ``argtypes`` on every entry point of ``library`` (a key of :data:`SIGNATURES`)."""
    for name, (restype, argtypes) in SIGNATURES[library].items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
