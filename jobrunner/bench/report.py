"""A readable table of a bench result (the JSON form is the result dict itself)."""

from __future__ import annotations

from typing import Any

RUNS = (("ours", "ours"), ("ours_no_prefix_caching", "ours (no prefix cache)"), ("baseline", "hf generate"))
HEADER = ("run", "seconds", "prompt tok", "cached", "output tok", "out tok/s", "total tok/s", "peak RSS MiB",
          "CUDA MiB")


def render_text(result: dict[str, Any]) -> str:
    """The workload line, one table row per run, the ratios and our engine's prefill/decode split."""
    base = _baseline_label(result)
    rows = [_row(base if key == "baseline" else label, result[key]) for key, label in RUNS if result.get(key)]
    lines = [_workload_line(result["workload"]), *_table([HEADER, *rows])]
    if result.get("ratio") is not None:
        short = "vllm" if base.startswith("vllm") else "hf"
        lines.append(f"ours / {short}: output tokens/s x{result['ratio']:.2f}, "
                     f"total tokens/s x{result['total_tokens_ratio']:.2f}")
    if result.get("prefix_caching"):
        p = result["prefix_caching"]
        lines.append(f"prefix caching: computed prompt tokens {p['computed_prompt_tokens_off']} -> "
                     f"{p['computed_prompt_tokens_on']} (cut {p['computed_prompt_tokens_cut']:.1%}), "
                     f"cached share {p['cached_token_share']:.1%}, output tokens/s on/off "
                     f"x{p['throughput_ratio'] or 0:.2f}")
    lines += [_engine_line(label, result[key]) for key, label in RUNS[:2] if result.get(key)]
    for key, label in RUNS[:2]:
        if (result.get(key) or {}).get("profile"):
            lines += profile_lines(label, result[key]["profile"])
    return "\n".join(lines) + "\n"


PROFILE_HEADER = ("part", "total s", "ms/step", "share", "decode ms/step", "prefill ms/step")


def profile_lines(label: str, profile: dict[str, Any]) -> list[str]:
    """``--profile``: one row per part of a step (host work split below it), totals, per step and shares; the
    per-step times of decode-only steps and of steps with prompt tokens side by side."""
    kinds = profile["by_step_kind"]
    dec, pre = kinds["decode"], kinds["prefill"]
    covered = f", {profile['share_of_run']:.1%} of the run" if profile.get("share_of_run") else ""
    rows = [PROFILE_HEADER]
    for name, part in profile["parts"].items():
        rows.append((name, f"{part['seconds']:.3f}", f"{part['ms_per_step']:.2f}", f"{part['share']:.1%}",
                     _ms(dec, name), _ms(pre, name)))
        if name == "host":
            rows += [(f"  {sub}", f"{p['seconds']:.3f}", f"{p['ms_per_step']:.2f}", f"{p['share']:.1%}", "", "")
                     for sub, p in profile["host_parts"].items()]
    return [f"{label} profile: {profile['num_steps']} steps ({dec['num_steps']} decode-only, {pre['num_steps']} "
            f"with prompt tokens), {profile['seconds']:.2f} s in steps{covered}", *_table(rows)]


def _ms(kind: dict[str, Any], name: str) -> str:
    return f"{kind['ms_per_step'].get(name, 0.0):.2f}" if kind["num_steps"] else "-"


def _workload_line(w: dict[str, Any]) -> str:
    stop = "ignore_eos" if w["ignore_eos"] else "stop at EOS"
    return (f"{w['num_prompts']} prompts ({w['num_dropped_too_long']} dropped: too long), max_tokens "
            f"{w['max_tokens']} ({stop}), model {w['model']} {w['dtype']} on {w['device']}, quantization "
            f"{w['quantization']}, max_num_seqs {w['max_num_seqs']}, attention "
            f"{w.get('attention_backend', 'torch')}"
            + (f", tensor parallel {w['tensor_parallel_size']}" if w.get("tensor_parallel_size", 1) > 1 else ""))


def _baseline_label(result: dict[str, Any]) -> str:
    """'hf generate', or 'vllm 0.32.0' for bench --engine jobrunner,vllm."""
    base = result.get("baseline") or {}
    if base.get("name") == "vllm":
        return f"vllm {base.get('vllm_version') or ''}".strip()
    return "hf generate"


def _row(label: str, run: dict[str, Any]) -> tuple[str, ...]:
    if "batch_size" in run:
        label = f"{label} (bs {run['batch_size']})"
    mem = run.get("memory") or {}
    cuda = mem.get("cuda_max_allocated_mib")
    return (label, f"{run['seconds']:.2f}", str(run["num_prompt_tokens"]), str(run["num_cached_tokens"]),
            str(run["num_output_tokens"]), f"{run['output_tokens_per_s']:.1f}", f"{run['total_tokens_per_s']:.1f}",
            f"{mem.get('peak_rss_mib', 0):.0f}", "-" if cuda is None else f"{cuda:.0f}")


def _engine_line(label: str, run: dict[str, Any]) -> str:
    s = run.get("engine_stats") or {}
    errors = f", {run['num_errors']} errors ({run.get('first_error')})" if run.get("num_errors") else ""
    return (f"{label}: {s.get('steps', 0)} steps, prefill {s.get('prefill_s', 0):.2f} s "
            f"({s.get('num_prefill_tokens', 0)} tok), decode {s.get('decode_s', 0):.2f} s "
            f"({s.get('num_decode_tokens', 0)} tok), schedule {s.get('schedule_s', 0):.2f} s, "
            f"preemptions {s.get('num_preemptions', 0)}, KV peak {s.get('kv_peak_blocks_used', 0)}/"
            f"{s.get('kv_num_blocks', 0)} blocks{_draft_part(s)}{errors}")


def _draft_part(s: dict[str, Any]) -> str:
    """Speculative decoding's counters, when the run drafted anything."""
    if not s.get("num_draft_tokens"):
        return ""
    return (f", drafted {s['num_draft_tokens']} tok, accepted {s.get('num_accepted_tokens', 0)} "
            f"({s.get('draft_acceptance_rate', 0):.0%})")


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]
