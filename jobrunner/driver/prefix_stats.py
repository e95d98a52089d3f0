"""The driver's side of prefix grouping: publish the planned row order, and keep the job's ideal prefix-cache
hits in the manifest (`prefix_cache`; definition in driver/prefix_rows.py and docs/driver.md).

Each committed shard's shared block chains (chain -> prompts) are added into the manifest by chain hash;
the ideal cached tokens are block_size x sum over chains of (prompts - 1). The chains are kept (as hex keys)
so a resumed run goes on adding to them; past MAX_CHAINS distinct chains new ones are no longer tracked and
the ideal is marked a lower bound (`complete: false`).
"""

from __future__ import annotations

from typing import Any

from jobrunner.driver.prefix_plan import PLAN_KEY, PrefixPlan
from jobrunner.io.row_order import upload_row_order
from jobrunner.io.storage import Storage

CACHE_KEY = "prefix_cache"
MAX_CHAINS = 100_000


def publish_prefix_plan(storage: Storage, manifest: dict[str, Any], prefix: PrefixPlan | None) -> None:
    """Put the planned row order under the output (before any worker reads it) and record the plan."""
    if prefix is None:
        return
    if prefix.order_key and prefix.order_local:
        upload_row_order(storage, prefix.order_local, prefix.order_key)
    manifest[PLAN_KEY] = prefix.describe()


def add_chains(manifest: dict[str, Any], chains: dict[int, int], block_size: int) -> None:
    """Add one committed shard's shared chains to the job's ideal."""
    section = manifest.setdefault(CACHE_KEY, {"block_size": block_size, "ideal_cached_tokens": 0, "chains": {},
                                              "complete": True})
    known: dict[str, int] = section["chains"]
    ideal = 0
    for chain, n in chains.items():
        key = format(chain, "x")
        before = known.get(key)
        if before is None and len(known) >= MAX_CHAINS:
            section["complete"] = False
            ideal += n - 1
            continue
        known[key] = (before or 0) + n
        ideal += n if before else n - 1  # a chain seen before: all of this shard's prompts could have hit
    section["ideal_cached_tokens"] += ideal * int(section["block_size"])


def record_summary(manifest: dict[str, Any], totals: dict[str, Any]) -> None:
    """Put achieved vs ideal hits (from the job's totals) into the manifest's `prefix_cache`."""
    summary = prefix_summary({**manifest, "totals": totals})
    if summary is not None:
        manifest[CACHE_KEY].update({k: round(v, 6) if isinstance(v, float) else v for k, v in summary.items()})


def prefix_summary(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """Achieved vs ideal prefix-cache hits from a manifest's totals and `prefix_cache` (None without them)."""
    section = manifest.get(CACHE_KEY)
    totals = manifest.get("totals") or {}
    prompt = int(totals.get("num_prompt_tokens") or 0)
    if not isinstance(section, dict) or not prompt:
        return None
    cached = int(totals.get("num_cached_tokens") or 0)
    ideal = int(section.get("ideal_cached_tokens") or 0)
    return {"hit_rate": cached / prompt, "ideal_hit_rate": ideal / prompt, "cached_tokens": cached,
            "ideal_cached_tokens": ideal, "of_ideal": cached / ideal if ideal else None,
            "computed_prompt_tokens": prompt - cached, "ideal_computed_prompt_tokens": prompt - ideal,
            "ideal_is_lower_bound": not section.get("complete", True)}
