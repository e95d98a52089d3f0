"""Cost per million tokens from worker-seconds, a price per worker-hour and the engine's prefill/decode time.

    cost_usd          = worker_seconds * worker_hour_usd / 3600
    usd_per_m_total   = cost_usd / (input_tokens + output_tokens) * 1e6          (blended)
    prefill_share     = sum(workers.prefill_s) / sum(workers.prefill_s + workers.decode_s)
    usd_per_m_input   = cost_usd * prefill_share       / input_tokens  * 1e6
    usd_per_m_output  = cost_usd * (1 - prefill_share) / output_tokens * 1e6

Worker-seconds count from each worker's process start (actor start and model load included, as a cloud
bill does; reports show that start-up share on its own line), over every run of the job (a run stopped by
Ctrl-C or killed included: io/run_records.py). The steady-state price leaves out start-up and the work paid
for and later redone or lost: what the tokens cost once workers are up, the price of the job at scale.
Time a worker spent neither in prefill nor decode (start-up, waiting for shards) is shared in the same proportion.
A figure that cannot be computed (no price, no tokens, no engine time) is None, never NaN or inf. An embed /
score job only prefills: its whole cost is input cost (prefill_share 1), so $ / M input tokens is its price.
"""

from __future__ import annotations

PER_MILLION = 1_000_000.0


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def per_million(usd: float | None, tokens: float | None) -> float | None:
    """$ per million tokens, or None when there is no price or no tokens."""
    value = ratio(usd, tokens)
    return None if value is None else value * PER_MILLION


def prefill_share(prefill_s: float, decode_s: float) -> float | None:
    """Share of engine model time spent on prefill work; None when the engine recorded no time."""
    return ratio(prefill_s, prefill_s + decode_s)


NO_PRICE_NOTE = "no price: pass --worker-hour-usd or set cost.worker_hour_usd in the job spec"
NO_SPLIT_NOTE = "no engine prefill/decode time in the manifest: input/output split unavailable"


def without_worker_hour_notes(notes: list[str]) -> list[str]:
    """`notes` less the worker-hour price's: a job priced per token (an endpoint) needs no worker-hour price,
    and its engine has no prefill / decode split to share one out."""
    return [n for n in notes if n not in (NO_PRICE_NOTE, NO_SPLIT_NOTE)]


def cost_figures(worker_seconds: float | None, worker_hour_usd: float | None, input_tokens: int,
                 output_tokens: int, prefill_s: float, decode_s: float, prefill_only: bool = False) -> dict:
    """The cost block of a report (see the module docstring for the formula). ``prefill_only``: an embed /
    score job, whose whole cost is input cost (no output tokens by design, not by failure)."""
    if prefill_only:
        prefill_s, decode_s = prefill_s + decode_s, 0.0
    total_usd = None
    if worker_seconds is not None and worker_hour_usd is not None:
        total_usd = worker_seconds * worker_hour_usd / 3600.0
    share = prefill_share(prefill_s, decode_s)
    input_usd = None if total_usd is None or share is None else total_usd * share
    output_usd = None if total_usd is None or share is None else total_usd * (1.0 - share)
    return {
        "worker_hour_usd": worker_hour_usd,
        "total_usd": total_usd,
        "prefill_share": share,
        "input_usd": input_usd,
        "output_usd": output_usd,
        "usd_per_m_input": per_million(input_usd, input_tokens),
        "usd_per_m_output": per_million(output_usd, output_tokens),
        "usd_per_m_total": per_million(total_usd, input_tokens + output_tokens),
        "notes": _cost_notes(worker_seconds, worker_hour_usd, share, input_tokens, output_tokens, prefill_only),
    }


def _cost_notes(worker_seconds: float | None, worker_hour_usd: float | None, share: float | None,
                input_tokens: int, output_tokens: int, prefill_only: bool = False) -> list[str]:
    notes = []
    if worker_hour_usd is None:
        notes.append(NO_PRICE_NOTE)
    if worker_seconds is None:
        notes.append("worker-seconds unknown (no manifest workers)")
    if share is None:
        notes.append(NO_SPLIT_NOTE)
    if input_tokens + output_tokens == 0:
        notes.append("no tokens processed: $ per million tokens undefined")
    elif prefill_only:
        notes.append("embed / score job: prefill only, so the whole cost is input cost ($ / M input tokens)")
    elif output_tokens == 0:
        notes.append("zero output tokens: $ per million output tokens undefined")
    return notes


def goodput_cost(cost: dict, good_input_tokens: int, good_output_tokens: int) -> dict:
    """$ per million tokens counting only the tokens of rows that met the SLO (the whole bill still paid)."""
    return {
        "usd_per_m_input": per_million(cost["input_usd"], good_input_tokens),
        "usd_per_m_output": per_million(cost["output_usd"], good_output_tokens),
        "usd_per_m_total": per_million(cost["total_usd"], good_input_tokens + good_output_tokens),
    }


def startup_cost(startup_s: float | None, worker_hour_usd: float | None) -> float | None:
    """The part of the bill spent starting workers and loading models (None without a price or figure); the
    same formula prices any part of the worker-seconds (work later redone or lost)."""
    if startup_s is None or worker_hour_usd is None:
        return None
    return startup_s * worker_hour_usd / 3600.0


def steady_state_cost(worker_seconds: float | None, overhead_s: float, worker_hour_usd: float | None,
                      input_tokens: int, output_tokens: int, prefill_s: float, decode_s: float,
                      prefill_only: bool = False) -> dict:
    """$ per million tokens at steady state: the job's worker-seconds less `overhead_s` (start-up, and work
    paid for and later redone or lost), split by the same prefill share. What a long job pays per token once
    its workers are up: start-up is paid once per worker, so its share shrinks as the job grows."""
    busy = None if worker_seconds is None else max(0.0, worker_seconds - overhead_s)
    figures = cost_figures(busy or None, worker_hour_usd, input_tokens, output_tokens, prefill_s, decode_s,
                           prefill_only)
    return {"worker_seconds": busy, "total_usd": figures["total_usd"],
            **{k: figures[k] for k in ("usd_per_m_input", "usd_per_m_output", "usd_per_m_total")}}


def token_priced_cost(input_tokens: int, output_tokens: int, usd_per_m_input: float | None,
                      usd_per_m_output: float | None, spent_usd: float | None = None) -> dict | None:
    """The cost at per-token prices (an endpoint's price list, `cost.usd_per_m_input` / `usd_per_m_output`):
    the output's tokens priced, its blended $ / M, and `spent_usd`, what the workers counted at those prices
    over every request they sent (rows of a run stopped early included). None when no price is set."""
    if usd_per_m_input is None and usd_per_m_output is None:
        return None
    total = (input_tokens * (usd_per_m_input or 0.0) + output_tokens * (usd_per_m_output or 0.0)) / PER_MILLION
    return {"usd_per_m_input": usd_per_m_input, "usd_per_m_output": usd_per_m_output, "total_usd": total,
            "usd_per_m_total": per_million(total, input_tokens + output_tokens), "spent_usd": spent_usd}
