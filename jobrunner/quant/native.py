"""One-pass int4 unpack for CPU: a C loop (``csrc/int4_unpack.c``) built with the system C compiler on first use.

Why: the large-batch int4 path must undo the CPU kernel's block layout ([blocks, K, block_n / 2] bytes) into
W^T [K, N]. With torch ops that takes two strided uint8 -> float copies plus a multiply and an add (~1 ms per
1.8 M weights on one AVX2 core, a third of the float32 GEMM it feeds at 64 tokens). This loop reads each byte
once and writes each float once, with the scale and offset applied on the way (vectorized by the compiler
for this CPU, ``-march=native``; OpenMP over K).

It is plain C called through ctypes (no torch headers, so it builds in about a second), cached under
``~/.cache/jobrunner`` per source, compiler, flags and CPU (:func:`build_library`, the one native build:
``w8a8_native`` builds ``csrc/w8a8.c`` with it too). The instruction set follows the dispatch's CPU
capability: ``-march=native``, or, where the capability is forced (``JOBRUNNER_CPU_CAPABILITY=avx2``), that
ISA (``-march=haswell`` for avx2), so a forced-AVX2 run measures the code an AVX2-only CPU would run.
No compiler, a failed build, or ``JOBRUNNER_QUANT_NATIVE=0``: :func:`int4_unpack_fn` returns ``None`` and the
torch path runs.
The library links ``libgomp.so.1``; where torch's own OpenMP runtime has that name (this venv) the loader
reuses it, so there is one thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from jobrunner.quant.capability import detect_cpu_capability

NATIVE_ENV = "JOBRUNNER_QUANT_NATIVE"
CSRC = Path(__file__).parent / "csrc"  # the C sources (int4_unpack.c, w8a8.c), one library each
COMMON_INCLUDE = Path(__file__).parent.parent / "csrc"  # headers every kernel may include (jr_numerics.h)


Unpack = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool, int], None]


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(NATIVE_ENV, "1").strip() == "0":
        return None
    try:
        return ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        warnings.warn(f"jobrunner.quant: native int4 unpack unavailable ({exc}); using torch ops", stacklevel=2)
        return None


UNPACK_SYMBOLS = {torch.float32: "jr_int4_unpack_t", torch.bfloat16: "jr_int4_unpack_t_bf16"}


@functools.cache
def int4_unpack_fn(dtype: torch.dtype = torch.float32) -> Unpack | None:
    """The compiled unpack writing ``dtype`` (float32 or bfloat16) as ``fn(packed_blocks, scale, offset, out,
    block_n, split, group)``, or ``None`` (no such variant, or no native code here)."""
    lib = _library() if dtype in UNPACK_SYMBOLS else None
    if lib is None:
        return None
    fn = getattr(lib, UNPACK_SYMBOLS[dtype])
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 7

    def unpack(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, out: torch.Tensor,
               block_n: int, split: bool, group: int) -> None:
        # packed: uint8 [nb, K, block_n / 2]; scale, offset: float32 [K / group, ld]; out: dtype [K, ld],
        # of which the first nb * block_n columns are written
        nb, k, _ = packed.shape
        if out.shape[1] < nb * block_n or scale.shape[1] != out.shape[1] or offset.shape != scale.shape:
            raise ValueError("native int4 unpack: out / scale / offset widths do not match")
        for t, want in ((packed, torch.uint8), (scale, torch.float32), (offset, torch.float32), (out, dtype)):
            if t.dtype != want or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"native int4 unpack: expected a contiguous CPU {want} tensor, got {t.dtype}")
        fn(packed.data_ptr(), scale.data_ptr(), offset.data_ptr(), out.data_ptr(), k, nb, block_n, int(split),
           group, out.shape[1], torch.get_num_threads())

    return unpack


# fn(packed_blocks uint8 [nb, K, block_n / 2], pairs bf16 [groups, >= nb * block_n, 2] (a column slice of the
# layer's scales_and_zeros), inv_row_scale float32 [nb * block_n], out int8 [K, ld], block_n, split, group)
ToInt8 = Callable[..., None]


@functools.cache
def int4_to_int8_fn() -> ToInt8 | None:
    """The compiled int4 -> int8 expansion (the int4 layer's int8-GEMM path), or ``None`` without native code.

    Row ``c`` of the packed blocks becomes ``rint(((code - 8) * scale + zero) / row_scale[c])`` in [-127, 127],
    written transposed (``out[k, c]``), the ``B`` operand of ``torch._int_mm``."""
    lib = _library()
    if lib is None:
        return None
    fn = lib.jr_int4_to_int8_t
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 8

    def expand(packed: torch.Tensor, pairs: torch.Tensor, inv_row_scale: torch.Tensor, out: torch.Tensor,
               block_n: int, split: bool, group: int) -> None:
        nb, k, _ = packed.shape
        cols = nb * block_n
        if out.shape[0] != k or out.shape[1] < cols or inv_row_scale.numel() < cols or pairs.shape[1] < cols:
            raise ValueError("native int4 -> int8: out / pairs / row scale widths do not match")
        checks = ((packed, torch.uint8), (inv_row_scale, torch.float32), (out, torch.int8), (pairs, torch.bfloat16))
        for t, want in checks:
            if t.dtype != want or t.device.type != "cpu" or (t is not pairs and not t.is_contiguous()):
                raise ValueError(f"native int4 -> int8: expected a contiguous CPU {want} tensor, got {t.dtype}")
        if pairs.stride(2) != 1 or pairs.stride(1) != 2:
            raise ValueError("native int4 -> int8: pairs must be [groups, rows, 2] with contiguous rows")
        if block_n > 64 or block_n % 2:
            raise ValueError(f"native int4 -> int8: blocks of {block_n} rows (at most 64, even)")
        fn(packed.data_ptr(), pairs.data_ptr(), inv_row_scale.data_ptr(), out.data_ptr(), k, nb, block_n,
           int(split), group, out.stride(0), pairs.stride(0) // 2, torch.get_num_threads())

    return expand


def _build() -> Path:
    return build_library("int4_unpack")


def open_library(name: str, source: Path, what: str, declare: Callable[[ctypes.CDLL], None],
                 extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | str:
    """Build ``source`` for this CPU (:func:`build_library`), load it and ``declare`` its functions' ctypes
    types; or the reason it cannot (``"<what> unavailable (...)"``, with the compiler's last words)."""
    try:
        lib = ctypes.CDLL(str(build_library(name, extra_flags, source)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"{what} unavailable ({exc}{': ' + detail.decode()[-400:] if detail else ''})"
    declare(lib)
    return lib


AMX_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512bf16")  # the tile kernels' build (they include jr_amx.h)


def open_amx_library(name: str, source: Path, what: str, declare: Callable[[ctypes.CDLL], None],
                     ready: str) -> ctypes.CDLL | str:
    """:func:`open_library` for a kernel on the AMX tiles, then its ``ready`` function (declared by ``declare``)
    asks the OS for the tile state: the library, or why it cannot run here."""
    lib = open_library(name, source, what, declare, extra_flags=AMX_FLAGS)
    if not isinstance(lib, str) and not getattr(lib, ready)():
        return f"{what} unavailable (the OS refused the AMX tile state)"
    return lib


def source_path(name: str) -> Path:
    """The C source ``csrc/<name>.c`` shipped in the package (pyproject's package-data)."""
    return CSRC / f"{name}.c"


def build_library(name: str, extra_flags: tuple[str, ...] = (), source: Path | None = None) -> Path:
    """Compile ``csrc/<name>.c`` (or ``source``, a C file of another package such as attention's) for this
    CPU into a cached shared library ``<cache>/jobrunner/<name>_<key>.so``
    (the key covers the source text, compiler, flags and CPU, so an edited source builds anew); OSError without
    a compiler or the source, CalledProcessError on a failed build."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler on PATH")
    src = source or source_path(name)
    source = src.read_text(encoding="utf-8")
    flags = ["-O3", march_flag(), "-fopenmp", f"-I{COMMON_INCLUDE}", *extra_flags, "-shared", "-fPIC"]
    headers = [h.read_text(encoding="utf-8") for h in sorted(COMMON_INCLUDE.glob("*.h"))]  # an edit rebuilds too
    key = hashlib.sha256("\0".join([source, *headers, compiler, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    target = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jobrunner" / f"{name}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        lib = Path(tmp) / f"{name}.so"
        subprocess.run([compiler, *flags, str(src), "-o", str(lib)], check=True, capture_output=True, timeout=120)
        os.replace(lib, target)  # atomic: concurrent workers build the same file
    return target


# -march for a forced capability (what that CPU class has; the tuning stays generic)
FORCED_MARCH = {"default": "-march=x86-64", "avx2": "-march=haswell", "avx512": "-march=skylake-avx512",
                "avx512_vnni": "-march=cascadelake",
                "avx512_bf16": "-march=cooperlake", "amx": "-march=sapphirerapids"}


def march_flag() -> str:
    """``-march=native``, or the ISA of a forced capability (see :mod:`jobrunner.quant.capability`)."""
    capability, forced = detect_cpu_capability()
    return FORCED_MARCH[capability] if forced else "-march=native"


def _cpu_id() -> str:
    """What ``-march=native`` depends on (the .so is rebuilt on another CPU sharing the cache directory)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()
