"""The one native build and loader: every C library of the engine is compiled here, for this CPU, and loaded
with its functions declared (until issue 46: ``quant/native.py``, imported by seven modules outside quant).

The kernels are plain C called through ctypes (no torch headers, so a library builds in about a second), built
with the system C compiler on first use and cached under ``~/.cache/jobrunner`` per source, headers, compiler,
flags and CPU (:func:`build_library`). The instruction set follows the CPU capability
(:mod:`jobrunner.kernels.capability`): ``-march=native``, or, where the capability is forced
(``JOBRUNNER_CPU_CAPABILITY=avx2``), that ISA (``-march=haswell`` for avx2), so a forced-AVX2 run measures the
code an AVX2-only CPU would run. Every source sees ``csrc/include`` (``-I``): the prototypes (``jr_kernels.h``)
and the shared numerics. :func:`load` builds a library of :data:`LIBRARIES` and declares every entry point it
defines from :mod:`jobrunner.kernels.signatures`; no compiler or a failed build gives the reason as text (with
the compiler's last words), which the wrappers pass on and turn into their torch fallback.
The libraries link ``libgomp.so.1``; where torch's own OpenMP runtime has that name (this venv) the loader
reuses it, so there is one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from jobrunner.kernels.capability import detect_cpu_capability
from jobrunner.kernels.signatures import declare

CSRC = Path(__file__).parent / "csrc"  # the C sources, by role (attention/, gemm/, rowops/, quant/, layer_loop.c)
INCLUDE = CSRC / "include"  # headers every kernel may include (jr_kernels.h, jr_numerics.h, jr_simd.h, jr_amx.h)
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512bf16")  # the tile kernels' build (they include jr_amx.h)


@dataclass(frozen=True)
class Library:
    """One shared library: its source under ``csrc/``, what it is (for messages), its extra compiler flags and,
    for the kernels of an ISA extension, the function that asks whether it runs here (the AMX kernels: whether
    the OS grants the tile state) and what to say when it does not."""

    source: str
    what: str
    flags: tuple[str, ...] = ()
    ready: str | None = None
    not_ready: str = "the OS refused the AMX tile state"
    prototypes: str | None = None  # the library whose block of jr_kernels.h declares it (None: its own name)


LIBRARIES: dict[str, Library] = {
    "paged_attention": Library("attention/paged_attention.c", "native paged attention"),
    "amx_attention": Library("attention/amx_attention.c", "AMX prompt attention", AMX_FLAGS, "jr_amx_ready"),
    # the AMX attention kernels' source built without tiles: its prompt and decode blocks on AVX-512 BF16
    # (include/jr_prompt_avx512.h, include/jr_decode_avx512.h)
    "bf16_attention": Library("attention/amx_attention.c", "AVX-512 BF16 attention",
                              ("-mavx512f", "-mavx512bf16", "-DJR_TILE_AVX512"), "jr_amx_ready",
                              "this CPU has no AVX-512 BF16", "amx_attention"),
    "packed_gemm": Library("gemm/packed_gemm.c", "packed GEMM"),
    "amx_gemm": Library("gemm/amx_gemm.c", "AMX GEMM", AMX_FLAGS, "jr_amx_gemm_ready"),
    "bf16_gemm": Library("gemm/bf16_gemm.c", "AVX-512 BF16 GEMM", ("-mavx512f", "-mavx512bf16"),
                         "jr_bf16_gemm_ready", "this CPU has no AVX-512 BF16"),
    "i8_gemm": Library("gemm/i8_gemm.c", "AVX-512 VNNI W8A8 GEMM", ("-mavx512f", "-mavx512bw", "-mavx512vnni",
                       "-mavx512bf16"), "jr_i8_gemm_ready", "this CPU has no AVX-512 VNNI and BF16"),
    # the same source on AMX-INT8 tiles; and with the tile operations emulated on AVX-512 (tests of that source
    # on CPUs without AMX)
    "amx_i8_gemm": Library("gemm/i8_gemm.c", "AMX-INT8 W8A8 GEMM", ("-mamx-tile", "-mamx-int8", "-mavx512f",
                           "-mavx512bw", "-mavx512vnni", "-mavx512bf16", "-DJR_W8A8_TILES"), "jr_i8_gemm_ready",
                           prototypes="i8_gemm"),
    "i8_tile_emulated": Library("gemm/i8_gemm.c", "W8A8 tile GEMM emulated on AVX-512", (
        "-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx512bf16", "-DJR_W8A8_TILES", "-DJR_TILE_AVX512"),
        "jr_i8_gemm_ready", "this CPU has no AVX-512 VNNI and BF16", "i8_gemm"),
    "fused_ops": Library("rowops/fused_ops.c", "fused ops", ("-ffp-contract=off",)),
    "row_argmax": Library("rowops/row_argmax.c", "native argmax"),
    "int4_unpack": Library("quant/int4_unpack.c", "native int4 unpack"),
    "w8a8": Library("quant/w8a8.c", "native W8A8", ("-fno-math-errno",)),
    "layer_loop": Library("layer_loop.c", "layer loop"),
}


def source_path(name: str) -> Path:
    """The C source of library ``name`` shipped in the package (pyproject's package-data)."""
    return CSRC / LIBRARIES[name].source


def load(name: str) -> ctypes.CDLL | str:
    """Build library ``name`` for this CPU, load it and declare its entry points; or the reason it cannot run
    (``"<what> unavailable (...)"``). Not cached here: the wrappers keep one per capability."""
    spec = LIBRARIES[name]
    try:
        lib = ctypes.CDLL(str(build_library(name)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        return f"{spec.what} unavailable ({exc}{': ' + detail.decode()[-400:] if detail else ''})"
    declare(lib, spec.prototypes or name)
    if spec.ready and not getattr(lib, spec.ready)():
        return f"{spec.what} unavailable ({spec.not_ready})"
    return lib


def build_library(name: str, extra_flags: tuple[str, ...] = (), source: Path | None = None) -> Path:
    """Compile library ``name`` (its source, or ``source``) for this CPU into a cached shared library
    ``<cache>/jobrunner/<name>_<key>.so`` (the key covers the source text, the headers, compiler, flags and CPU,
    so an edited source or header builds anew); OSError without a compiler or the source, CalledProcessError on
    a failed build."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler on PATH")
    src = source or source_path(name)
    text = src.read_text(encoding="utf-8")
    spec_flags = LIBRARIES[name].flags if name in LIBRARIES else ()
    flags = ["-O3", march_flag(), "-fopenmp", f"-I{INCLUDE}", *spec_flags, *extra_flags, "-shared", "-fPIC"]
    headers = [h.read_text(encoding="utf-8") for h in sorted(INCLUDE.glob("*.h"))]  # an edit rebuilds too
    key = hashlib.sha256("\0".join([text, *headers, compiler, *flags, _cpu_id()]).encode()).hexdigest()[:16]
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
    """``-march=native``, or the ISA of a forced capability (see :mod:`jobrunner.kernels.capability`)."""
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
