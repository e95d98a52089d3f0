"""The native layer's one build and its one signature table: every library of kernels/build.py builds from its
place under kernels/csrc, declares every entry point of jr_kernels.h, exports nothing undeclared, and the
layer loop's ctypes structures have C's sizes."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from jobrunner.kernels import LIBRARIES, SIGNATURES, build_library, load
from jobrunner.kernels.build import CSRC, INCLUDE
from jobrunner.kernels.signatures import LoopLayer, LoopModel, LoopRows, LoopStep, parse_header
from tests.components import missing_component, native_build_failed, require_library


def _built(name: str) -> Path:
    try:
        return build_library(name)
    except OSError as exc:
        native_build_failed(f"the {name} build failed ({exc})")


def test_every_library_has_its_block_of_prototypes():
    assert set(SIGNATURES) == {spec.prototypes or name for name, spec in LIBRARIES.items()}
    assert sum(len(fns) for fns in SIGNATURES.values()) == 36
    restype, argtypes = SIGNATURES["fused_ops"]["jr_rms_norm"]
    assert restype is ctypes.c_int
    assert argtypes == [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 2 + [ctypes.c_float] + [ctypes.c_int64] * 2
    assert SIGNATURES["int4_unpack"]["jr_int4_unpack_t"][0] is None  # void
    assert SIGNATURES["amx_attention"]["jr_amx_workspace_bytes"][0] is ctypes.c_int64
    assert SIGNATURES["layer_loop"]["jr_layer_loop"][1][3]._type_ is ctypes.c_double


def test_the_parser_refuses_a_type_it_does_not_know():
    with pytest.raises(ValueError, match="no ctypes type for C type 'short'"):
        parse_header("/* library x: x.c */\nint jr_x(short a);\n")


def test_every_source_includes_the_prototypes_and_lives_by_role():
    sources = sorted(p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*.c"))
    assert sources == sorted({spec.source for spec in LIBRARIES.values()})  # bf16_attention: amx_attention.c
    assert all('#include "jr_kernels.h"' in (CSRC / s).read_text(encoding="utf-8") for s in sources)
    loop = (CSRC / "layer_loop.c").read_text(encoding="utf-8")
    assert "typedef int (*" not in loop and "typedef struct" not in loop  # its types come from the header


@pytest.mark.parametrize("name", sorted(LIBRARIES))
def test_each_library_exports_exactly_its_declared_entry_points(name):
    """The prototypes are the library's whole interface: ``nm`` lists no jr_ function the header lacks, and
    every declared one resolves (AMX libraries build and load on any x86 CPU; only their calls need AMX)."""
    path = _built(name)
    lib = ctypes.CDLL(str(path))
    declared = SIGNATURES[LIBRARIES[name].prototypes or name]
    assert all(hasattr(lib, fn) for fn in declared)
    if shutil.which("nm") is None:
        missing_component("nm (binutils) to list the library's symbols")
    listing = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    exported = set(re.findall(r" T (jr_\w+)$", listing.stdout, re.MULTILINE))
    assert exported == set(declared)


def test_load_declares_from_the_table():
    lib = require_library(load("row_argmax"))
    assert lib.jr_row_argmax.restype is ctypes.c_int
    assert lib.jr_row_argmax.argtypes == SIGNATURES["row_argmax"]["jr_row_argmax"][1]


def test_the_layer_loop_structures_have_the_sizes_of_c():
    lib = require_library(load("layer_loop"))
    sizes = (ctypes.c_int64 * 4)()
    assert lib.jr_loop_struct_sizes(sizes) == 4
    assert list(sizes) == [ctypes.sizeof(s) for s in (LoopModel, LoopLayer, LoopRows, LoopStep)]


def test_the_headers_sit_in_include():
    assert sorted(p.name for p in INCLUDE.glob("*.h")) == ["jr_amx.h", "jr_decode_avx512.h", "jr_kernels.h",
                                                          "jr_numerics.h", "jr_prompt_avx512.h", "jr_simd.h",
                                                          "jr_tile_avx512.h", "jr_tile_pack.h"]
