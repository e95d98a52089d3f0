"""Where a step's time goes: attention, GEMMs, other model ops and host work (``jobrunner bench --profile``).

A :class:`StepProfiler` attached to an engine (a context manager) keeps a stack of open *regions* and charges
the wall time between two boundaries to the region on top, so a region's time excludes the regions opened
inside it and the parts of a step add up to the step exactly:

* ``host``: the step itself, whatever no inner region claims; inside it ``host.schedule`` (the scheduler),
  ``host.inputs`` (the step's layout, the upload of its integer inputs, the backend's metadata) and
  ``host.outputs`` (appending tokens, stop checks, freeing blocks, finished outputs);
* ``other``: the model forward (embedding, norms, rotary, activations, residual adds) and the sampler's math;
* ``gemm``: every projection (q|k|v, o, gate|up, down, lm_head; whatever class quantization put there);
* ``attention``: each layer's attention call (the K/V write into the cache and the attention itself);
* ``graph``: a CUDA-graph replay, which runs the whole model without Python (not split; absent on CPU);
* ``vision``: a vision-language model's image encoder (vision tower + connector, engine/vision.py; absent for
  text models and steps without new images).

Nothing is installed while detached: the forward hooks (projections, the model) and the instance attributes
over a few methods (step, schedule, layout, the step runner, the sampler, each layer's ``attend``) exist only
inside ``with StepProfiler(engine):``. CPU torch ops run synchronously, so a clock read at a boundary is exact
there; on CUDA every boundary first synchronizes the device (slower, but honest).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

CATEGORIES = ("attention", "gemm", "other", "host")
HOST_PARTS = ("schedule", "inputs", "outputs", "rest")
# the model's projection modules, by attribute name (jobrunner.models.llama)
PROJECTIONS = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"})


class _Clock:
    """Exclusive wall time per region label on a stack of open regions."""

    def __init__(self, device: torch.device) -> None:
        self.is_cuda = device.type == "cuda"
        self.stack: list[str] = []
        self.mark = 0.0
        self.seconds: dict[str, float] = defaultdict(float)  # label -> seconds, this step

    def _now(self) -> float:
        if self.is_cuda and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        return time.perf_counter()

    def enter(self, label: str) -> None:
        now = self._now()
        if self.stack:
            self.seconds[self.stack[-1]] += now - self.mark
        self.stack.append(label)
        self.mark = now

    def exit(self) -> None:
        now = self._now()
        self.seconds[self.stack.pop()] += now - self.mark
        self.mark = now

    def charge(self, label: str, seconds: float) -> None:
        """Move ``seconds`` that the open region spent on ``label``'s work (timed by native code, e.g. the C
        layer loop of ``models/layer_loop.py``) from that region to ``label``."""
        self.seconds[label] += seconds
        self.mark += seconds

    def timed(self, label: str, fn: Callable) -> Callable:
        """``fn`` inside a region called ``label``."""
        def wrapper(*args, **kwargs):
            self.enter(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()
        return wrapper


class StepProfiler:
    """Times every ``engine.step()`` while attached; :meth:`summary` gives totals, shares and per-step rows.

    Use ``with StepProfiler(engine) as profiler: ...`` around the steps to time; a step that runs no model
    (nothing scheduled) is not counted.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.clock = _Clock(engine.device)
        self.steps: list[dict[str, Any]] = []
        self._undo: list[Callable[[], None]] = []
        self._forwards = 0

    # -- attach / detach -----------------------------------------------------------------------------------

    def __enter__(self) -> StepProfiler:
        e, runner = self.engine, self.engine.runner
        self._wrap(e, "step", self._step(e.step))
        self._wrap(e.scheduler, "schedule", self.clock.timed("host.schedule", e.scheduler.schedule))
        self._wrap(e.scheduler, "update_from_output",
                   self.clock.timed("host.outputs", e.scheduler.update_from_output))
        self._wrap(runner, "_layout", self.clock.timed("host.inputs", runner._layout))
        self._wrap(runner.steps, "run", self.clock.timed("host.inputs", runner.steps.run))
        fixed = runner.steps.fixed
        if fixed is not None and getattr(fixed, "capture", False) and e.device.type == "cuda":
            self._wrap(fixed, "run_step", self.clock.timed("graph", fixed.run_step))
        self._wrap(runner.sampler, "sample_on_device", self.clock.timed("other", runner.sampler.sample_on_device))
        if getattr(runner, "images", None) is not None:  # a vision-language model's encoder (engine/vision.py)
            self._wrap(runner.images, "encode", self.clock.timed("vision", runner.images.encode))
        self._hook(e.model, "other", counts=True)
        self._wrap(e.model, "layer_loop_clock", self.clock)  # the C layer loop's own timers (models/layer_loop.py)
        for name, module in e.model.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                self._hook(module, "gemm")
            elif hasattr(module, "attend"):  # models.llama.Attention: its paged-attention call
                self._wrap(module, "attend", self.clock.timed("attention", module.attend))
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap(self, obj, name: str, replacement: Callable) -> None:
        """Shadow ``obj.name`` with ``replacement`` (an instance attribute) until detached."""
        had = name in vars(obj)
        original = vars(obj).get(name)
        setattr(obj, name, replacement)
        self._undo.append(lambda: setattr(obj, name, original) if had else delattr(obj, name))

    def _hook(self, module: torch.nn.Module, label: str, counts: bool = False) -> None:
        def pre(_module, _args):
            self._forwards += counts
            self.clock.enter(label)

        handles = (module.register_forward_pre_hook(pre),
                   module.register_forward_hook(lambda *_: self.clock.exit(), always_call=True))
        self._undo.extend(h.remove for h in handles)

    def _step(self, step: Callable) -> Callable:
        def profiled_step():
            stats = self.engine.stats()
            before = (self._forwards, stats.num_prefill_tokens, stats.num_decode_tokens)
            self.clock.seconds.clear()
            self.clock.enter("host")
            try:
                return step()
            finally:
                self.clock.exit()
                if self._forwards > before[0] or self.clock.seconds.get("graph"):
                    self._record(stats.num_prefill_tokens - before[1], stats.num_decode_tokens - before[2])
        return profiled_step

    def _record(self, num_prefill: int, num_decode: int) -> None:
        row: dict[str, Any] = {"num_prefill_tokens": num_prefill, "num_decode_tokens": num_decode}
        row.update(dict(self.clock.seconds))
        self.steps.append(row)

    # -- results -------------------------------------------------------------------------------------------

    def summary(self, run_seconds: float | None = None) -> dict[str, Any]:
        """Totals per part, each as ms per step and a share of the steps' time; the host parts; the same for
        decode-only steps and steps with prompt tokens; and one row per step (ms). ``run_seconds``: the
        whole timed run, to say how much of it the steps cover."""
        total = sum(_step_seconds(s) for s in self.steps)
        out: dict[str, Any] = {"num_steps": len(self.steps), "seconds": round(total, 6),
                               "parts": _parts(self.steps, total), "host_parts": _host_parts(self.steps, total)}
        if run_seconds:
            out["share_of_run"] = total / run_seconds
        decode = [s for s in self.steps if not s["num_prefill_tokens"]]
        prefill = [s for s in self.steps if s["num_prefill_tokens"]]
        out["by_step_kind"] = {"decode": _kind(decode), "prefill": _kind(prefill)}
        out["steps"] = [_step_row(s) for s in self.steps]
        return out


def _labels(step: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in step.items() if not k.startswith("num_")}


def _step_seconds(step: dict[str, Any]) -> float:
    return sum(_labels(step).values())


def _category(label: str) -> str:
    return label.split(".", 1)[0]


def _category_seconds(steps: list[dict[str, Any]]) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for step in steps:
        for label, seconds in _labels(step).items():
            out[_category(label)] = out.get(_category(label), 0.0) + seconds
    return out


def _parts(steps: list[dict[str, Any]], total: float) -> dict[str, dict[str, float]]:
    n = max(len(steps), 1)
    return {name: {"seconds": round(s, 6), "ms_per_step": round(1e3 * s / n, 3), "share": s / total if total else 0.0}
            for name, s in _category_seconds(steps).items() if name in CATEGORIES or s}


def _host_parts(steps: list[dict[str, Any]], total: float) -> dict[str, dict[str, float]]:
    n = max(len(steps), 1)
    seconds = {part: sum(s.get(f"host.{part}", 0.0) for s in steps) for part in HOST_PARTS[:-1]}
    seconds["rest"] = sum(s.get("host", 0.0) for s in steps)
    return {part: {"seconds": round(v, 6), "ms_per_step": round(1e3 * v / n, 3), "share": v / total if total else 0.0}
            for part, v in seconds.items()}


def _kind(steps: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(steps)
    seconds = _category_seconds(steps)
    return {"num_steps": n, "num_tokens": sum(s["num_prefill_tokens"] + s["num_decode_tokens"] for s in steps),
            "ms_per_step": {k: round(1e3 * v / n, 3) if n else 0.0 for k, v in seconds.items()}}


def _step_row(step: dict[str, Any]) -> dict[str, Any]:
    seconds = _category_seconds([step])
    return {"num_prefill_tokens": step["num_prefill_tokens"], "num_decode_tokens": step["num_decode_tokens"],
            **{f"{k}_ms": round(1e3 * v, 3) for k, v in seconds.items()}}
