"""What a bench run says about price and how far to trust it: $ per million tokens at a worker-hour price, and
the machine's load, which makes tokens/s (and so the price) mean little when other processes share the CPUs.

The bench times only its run (the model is loaded and warmed up before), so its price is a steady-state price:
the same figure as a job report's `cost.steady_state` (docs/reports.md), with the same input / output split
(the engine's prefill vs decode time).
"""

from __future__ import annotations

import os
from typing import Any

from jobrunner.reports.cost import cost_figures

BUSY_SHARE = 0.5  # load from other processes above this share of the CPUs: the figures mean little


def bench_price(run: dict[str, Any], worker_hour_usd: float) -> dict[str, Any]:
    """$ / M input, output and total tokens of one timed bench run (`run`: the result's "ours")."""
    stats = run.get("engine_stats") or {}
    figures = cost_figures(float(run["seconds"]), worker_hour_usd, int(run["num_prompt_tokens"]),
                           int(run["num_output_tokens"]), float(stats.get("prefill_s") or 0.0),
                           float(stats.get("decode_s") or 0.0))
    keys = ("worker_hour_usd", "total_usd", "prefill_share", "usd_per_m_input", "usd_per_m_output",
            "usd_per_m_total")
    return {k: figures[k] for k in keys}


def price_line(price: dict[str, Any]) -> str:
    """"steady state at $2.00 / worker-hour: $ / M input 0.51, output 3.20, total 1.43" (n/a where undefined)."""
    def usd(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4g}"
    return (f"steady state at ${price['worker_hour_usd']:g} / worker-hour (one worker, start-up excluded): $ / M "
            f"input {usd(price['usd_per_m_input'])}, output {usd(price['usd_per_m_output'])}, total "
            f"{usd(price['usd_per_m_total'])}")


def num_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_load(own_threads: int = 0) -> dict[str, Any]:
    """The 1-minute load average, the CPUs, and the load other processes put on them (`own_threads`: what
    this process itself adds while it runs, left out)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return {"load_1m": None, "cpus": num_cpus(), "others_load": None, "others_share": None}
    cpus, others = num_cpus(), max(0.0, load - own_threads)
    return {"load_1m": round(load, 2), "cpus": cpus, "others_load": round(others, 2),
            "others_share": round(others / cpus, 2)}


def load_warning(before: dict[str, Any], after: dict[str, Any]) -> str | None:
    """A warning when other processes kept the CPUs busy before or during the run (None when idle enough)."""
    busy = [m for m in (before, after) if (m.get("others_share") or 0.0) >= BUSY_SHARE]
    if not busy:
        return None
    worst = max(busy, key=lambda m: m["others_share"])
    return (f"warning: the machine is busy (1-minute load {worst['load_1m']:g} on {worst['cpus']} CPUs: other "
            f"processes keep about {worst['others_load']:g} CPUs' worth busy): these tokens/s and $ / M understate "
            "what an idle worker does; rerun on an idle machine before quoting them")
