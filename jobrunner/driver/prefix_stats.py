"""The driver's side of prefix grouping: publish the planned row order, and keep the job's ideal prefix-cache
hits in the manifest (`prefix_cache`; definition in driver/prefix_rows.py and docs/driver.md).

ideal cached tokens = block_size x (cacheable blocks - distinct block chains) over the whole job. The blocks
are summed from the shards' reports; the distinct chains are counted exactly (a sorted array of chain
hashes) up to EXACT_CHAINS, and past that estimated with a HyperLogLog of 2^14 registers (standard error
~0.8% of the distinct count), so the manifest holds at most ~110 KB for it whatever the job's size. Both are kept in
the manifest (base64), so a resumed run goes on counting; the same chain seen again (a retried shard) is not
counted twice as distinct (its blocks are).
"""

from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

from jobrunner.driver.prefix_plan import PLAN_KEY, PrefixPlan
from jobrunner.io.row_order import upload_row_order
from jobrunner.io.storage import Storage
from jobrunner.prefix_view import ideal_over_covered

CACHE_KEY = "prefix_cache"
EXACT_CHAINS = 1 << 13  # distinct chains counted exactly (a 64 KB array); an estimate past that
HLL_BITS = 14


def publish_prefix_plan(storage: Storage, manifest: dict[str, Any], prefix: PrefixPlan | None) -> None:
    """Put the planned row order under the output (before any worker reads it) and record the plan."""
    if prefix is None:
        return
    if prefix.order_key and prefix.order_local:
        upload_row_order(storage, prefix.order_local, prefix.order_key)
    manifest[PLAN_KEY] = prefix.describe()


def add_chains(manifest: dict[str, Any], chains: tuple[int, np.ndarray | None], block_size: int,
               record: dict[str, Any] | None = None) -> None:
    """Add one committed shard's (cacheable blocks, distinct chains) to the job's ideal, and its prompt and
    cached tokens (`record`: its commit record) to the tokens the ideal covers: the achieved hits are compared
    with the ideal over the same shards (a run killed before its manifest was written loses its shards' chains,
    and then their hits must not count against the ideal either)."""
    num_blocks, hashes = chains
    section = manifest.setdefault(CACHE_KEY, {"block_size": block_size, "cacheable_blocks": 0,
                                              "ideal_cached_tokens": 0, "complete": True})
    if hashes is None:
        return
    for key in ("prompt", "cached"):
        covered = f"covered_{key}_tokens"
        section[covered] = int(section.get(covered) or 0) + int((record or {}).get(f"num_{key}_tokens") or 0)
    counter = DistinctChains.from_section(section)
    counter.add(hashes)
    section["cacheable_blocks"] = int(section.get("cacheable_blocks") or 0) + int(num_blocks)
    counter.to_section(section)
    distinct = section["distinct_chains"]
    section["ideal_cached_tokens"] = max(0, section["cacheable_blocks"] - distinct) * int(section["block_size"])


class DistinctChains:
    """Distinct 64-bit chain hashes: exact up to EXACT_CHAINS, then a HyperLogLog estimate."""

    def __init__(self, exact: np.ndarray | None, registers: np.ndarray) -> None:
        self.exact = exact  # sorted uint64, or None once past EXACT_CHAINS
        self.registers = registers  # uint8 [2^HLL_BITS]

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> DistinctChains:
        registers = np.zeros(1 << HLL_BITS, np.uint8)
        if section.get("hll"):
            registers = np.frombuffer(base64.b64decode(section["hll"]), np.uint8).copy()
        exact = np.zeros(0, np.uint64)
        if "exact_chains" in section:
            exact = None if section["exact_chains"] is None else np.frombuffer(
                base64.b64decode(section["exact_chains"]), "<u8").astype(np.uint64)
        return cls(exact, registers)

    def add(self, hashes: np.ndarray) -> None:
        hashes = np.asarray(hashes, np.uint64)
        mixed = _mix(hashes)
        index = (mixed >> np.uint64(64 - HLL_BITS)).astype(np.int64)
        rest = mixed << np.uint64(HLL_BITS)
        rank = np.minimum(_leading_zeros(rest) + 1, 64 - HLL_BITS + 1).astype(np.uint8)
        np.maximum.at(self.registers, index, rank)
        if self.exact is not None:
            merged = np.union1d(self.exact, hashes)
            self.exact = merged if len(merged) <= EXACT_CHAINS else None

    def count(self) -> int:
        if self.exact is not None:
            return len(self.exact)
        m = float(len(self.registers))
        estimate = 0.7213 / (1 + 1.079 / m) * m * m / float(np.sum(np.exp2(-self.registers.astype(np.float64))))
        zeros = int((self.registers == 0).sum())
        if estimate <= 2.5 * m and zeros:
            estimate = m * math.log(m / zeros)
        return int(round(estimate))

    def to_section(self, section: dict[str, Any]) -> None:
        section["hll"] = base64.b64encode(self.registers.tobytes()).decode()
        section["exact_chains"] = (None if self.exact is None else
                                   base64.b64encode(self.exact.astype("<u8").tobytes()).decode())
        section["distinct_chains"] = self.count()
        section["complete"] = self.exact is not None  # False: the distinct count is an estimate


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: spreads the chain hashes' bits evenly (the registers use the top bits)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _leading_zeros(x: np.ndarray) -> np.ndarray:
    """Leading zero bits of each uint64 (64 for 0)."""
    x = x.copy()
    n = np.zeros(len(x), np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        top_clear = x < (np.uint64(1) << np.uint64(64 - shift))
        n += np.where(top_clear, shift, 0)
        x = np.where(top_clear, x << np.uint64(shift), x)
    return n + (x == 0)


def record_summary(manifest: dict[str, Any], totals: dict[str, Any]) -> None:
    """Put achieved vs ideal hits (from the job's totals) into the manifest's `prefix_cache`."""
    summary = prefix_summary({**manifest, "totals": totals})
    if summary is not None:
        manifest[CACHE_KEY].update({k: round(v, 6) if isinstance(v, float) else v for k, v in summary.items()})


def prefix_summary(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """Achieved vs ideal prefix-cache hits from a manifest's totals and `prefix_cache` (None without them)."""
    section = manifest.get(CACHE_KEY)
    if not isinstance(section, dict):
        return None
    prompt, cached, ideal = ideal_over_covered(section, manifest.get("totals") or {})
    if not prompt:
        return None
    return {"hit_rate": cached / prompt, "ideal_hit_rate": ideal / prompt, "cached_tokens": cached,
            "ideal_cached_tokens": ideal, "of_ideal": cached / ideal if ideal else None,
            "computed_prompt_tokens": prompt - cached, "ideal_computed_prompt_tokens": prompt - ideal,
            "ideal_is_estimate": not section.get("complete", True)}

