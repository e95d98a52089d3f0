"""This CPU's instruction-set capability, detected or forced: the one fact both the kernel choices and the native
build depend on (:mod:`jobrunner.quant.dispatch` and the model / attention wrappers pick kernels by it,
:mod:`jobrunner.kernels.build` compiles for it), so it sits below all of them.

The capability comes from ``torch.backends.cpu.get_cpu_capability()`` plus torch's bf16/AMX/VNNI probes, or is
forced with ``JOBRUNNER_CPU_CAPABILITY`` or a ``capability=`` argument, so every decision is testable on any
machine.
"""

from __future__ import annotations

import functools

import torch

from jobrunner.kernels.switches import SWITCHES, setting, switch

CAPABILITY_ENV = "JOBRUNNER_CPU_CAPABILITY"
CPU_CAPABILITIES = SWITCHES[CAPABILITY_ENV].choices  # ("default", "avx2", ..., "amx")


def detect_cpu_capability(capability: str | None = None) -> tuple[str, bool]:
    """``(capability, forced)``: the argument, else ``$JOBRUNNER_CPU_CAPABILITY``, else what torch reports."""
    forced = capability or setting(CAPABILITY_ENV)
    if forced:
        value = forced.strip().lower()
        if value not in CPU_CAPABILITIES:
            raise ValueError(f"{CAPABILITY_ENV}={forced!r}: expected one of {'|'.join(CPU_CAPABILITIES)}")
        return value, True
    base = torch.backends.cpu.get_cpu_capability().lower()
    if base.startswith("avx512"):
        if torch.cpu._is_amx_tile_supported():
            return "amx", False
        if torch.cpu._is_avx512_bf16_supported():
            return "avx512_bf16", False
        return ("avx512_vnni" if torch.cpu._is_vnni_supported() else "avx512"), False
    return (base if base in CPU_CAPABILITIES else "default"), False


def capability_switch(env: str, default_on: frozenset[str], on_text: str, off_text: str) -> tuple[bool, str]:
    """``(on, why)`` for a path chosen by capability alone: ``$env`` = ``0`` turns it off, ``1`` on, otherwise it
    is on for the capabilities in ``default_on``. ``on_text`` / ``off_text`` follow ``"<capability>: "``."""
    value = switch(env)
    capability, _ = detect_cpu_capability()
    if value is False:
        return False, f"{env}=0"
    if value is not True and capability not in default_on:
        return False, f"{capability}: {off_text}"
    return True, f"{capability}: {on_text}"


def capability_key() -> str:
    """``"<capability>:<forced>"`` for keying a per-capability cache of native libraries; detected once per value
    of ``JOBRUNNER_CPU_CAPABILITY`` (cheap to ask on every op)."""
    return _capability_key(setting(CAPABILITY_ENV))


@functools.cache
def _capability_key(_forced_setting: str) -> str:
    capability, forced = detect_cpu_capability()
    return f"{capability}:{forced}"
