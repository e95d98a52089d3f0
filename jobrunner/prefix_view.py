"""The job's ideal prefix-cache hits as a manifest records them (`prefix_cache`, driver/prefix_stats.py), read
the same way by the driver's summary and by `report`."""

from __future__ import annotations

from typing import Any


def ideal_over_covered(section: dict[str, Any], totals: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt tokens, cached tokens, ideal cached tokens) over the shards whose chains the ideal counted (the
    job's totals for manifests written before `covered_*`). The ideal is never below the hits achieved: a
    distinct-chain estimate that overshoots (past EXACT_CHAINS) or an older manifest would put it there."""
    if "covered_prompt_tokens" in section:
        prompt, cached = int(section["covered_prompt_tokens"] or 0), int(section.get("covered_cached_tokens") or 0)
    else:
        prompt, cached = int(totals.get("num_prompt_tokens") or 0), int(totals.get("num_cached_tokens") or 0)
    return prompt, cached, max(int(section.get("ideal_cached_tokens") or 0), cached)
