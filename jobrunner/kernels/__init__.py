"""The native kernel layer under everything: the one C build and loader, CPU capability, the entry points'
signatures and the ``JOBRUNNER_*`` switches. Imports torch and ctypes, nothing else of jobrunner
(tests/test_layering.py holds it); docs/engine.md, *Native kernels*, shows the layout.

The thin Python wrappers (argument checks, tensors to pointers) stay with their users and ask this package
for a loaded library (:func:`load`), the capability and the switches. The switches table needs no torch, so
the names that do are loaded on first use (a CLI or spec module reading a switch does not import torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from jobrunner.kernels.switches import SWITCHES, is_off, is_set, setting, switch

_LAZY = {
    "LIBRARIES": "build", "build_library": "build", "load": "build", "march_flag": "build", "source_path": "build",
    "CAPABILITY_ENV": "capability", "CPU_CAPABILITIES": "capability", "capability_key": "capability",
    "capability_switch": "capability", "detect_cpu_capability": "capability",
    "SIGNATURES": "signatures", "LoopLayer": "signatures", "LoopModel": "signatures", "LoopRows": "signatures",
    "LoopStep": "signatures", "Int4Linear": "signatures",
}

__all__ = ["SWITCHES", "is_off", "is_set", "setting", "switch", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
