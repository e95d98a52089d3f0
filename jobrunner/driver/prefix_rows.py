"""A worker's side of prefix grouping: read a grouped shard's rows, admit rows sharing a prefix together, and
count the prefix blocks its rows share (for the job's ideal prefix-cache hits).

The ideal (docs/driver.md, "Prefix-aware sharding"): the engine caches full KV blocks of `block_size` tokens,
chained (a block's identity is its tokens and every token before it), and always computes a prompt's last
token, so a prompt of n tokens can reuse at most (n - 1) // block_size blocks. If every distinct block chain
of the job were computed exactly once, a chain that M prompts hold would be computed once and hit M - 1
times: ideal cached tokens = block_size x sum over chains of (M - 1) = block_size x (cacheable blocks -
distinct chains). A shard reports its cacheable blocks and its distinct chains; the driver sums the blocks
and counts the distinct chains of the whole job (driver/prefix_stats.py), whatever shards they came in.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pyarrow as pa

from jobrunner.driver.prefix_plan import key_text
from jobrunner.driver.rows import RowRequest, kept_columns, read_shard_input, request_columns
from jobrunner.driver.shards import Shard
from jobrunner.io.row_order import read_positions, read_rows_at
from jobrunner.io.storage import Storage
from jobrunner.spec import JobSpec

CHAIN_MASK = (1 << 63) - 1


def read_shard_rows(spec: JobSpec, shard: Shard, output: Storage) -> tuple[pa.Table, list[str], dict[int, int] | None]:
    """A shard's input rows, kept column names, and each row's position in the shard (ROW_INDEX -> position;
    None for a row range, where a row's position is its row): a row range, or (a prefix-grouped file) the
    rows at the shard's positions of the planned row order."""
    if shard.order_key is None:
        return (*read_shard_input(spec, shard.file_url, shard.row_start, shard.row_end, shard.pin), None)
    offset = shard.order_offset
    rows = read_positions(output, shard.order_key, offset + shard.row_start, offset + shard.row_end)
    inp, keep = spec.input, spec.output.keep_columns
    wanted = None if keep == "*" else list(dict.fromkeys(request_columns(spec) + keep))
    table = read_rows_at(shard.file_url, inp.storage_options, inp.format, rows, wanted, shard.pin)
    positions = {int(row): shard.row_start + i for i, row in enumerate(rows.tolist())}
    return table, kept_columns(spec, table.column_names), positions


def admission_order(spec: JobSpec, requests: list[RowRequest]) -> list[RowRequest]:
    """The requests sorted by LoRA adapter, then prompt text (then row), so rows sharing a prefix (and an adapter:
    the engine keys cached blocks by it) enter the engine one after another and find its blocks cached; input
    order when prefix grouping is off."""
    if spec.input.prefix_grouping == "off":
        return requests
    return sorted(requests, key=lambda r: (r.adapter or "", _prompt_text(r.prompt), r.row_index))


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        return key_text("messages", prompt)
    return ""


class PrefixChains:
    """Full-block chains of a shard's prompts: how many there are, and the distinct ones."""

    def __init__(self) -> None:
        self.num_blocks = 0  # cacheable blocks over the prompts, (n - 1) // block_size each
        self.chains: set[int] = set()

    def add(self, prompt_token_ids: Any, block_size: int, adapter: str | None = None) -> None:
        """Count one prompt's cacheable block chains ((n - 1) // block_size of them); a prompt run with a LoRA
        adapter starts its chain from the adapter's name (a stable checksum: workers must agree), as the
        engine's cache keys its blocks by the adapter."""
        if not prompt_token_ids or block_size <= 0:
            return
        tokens = list(prompt_token_ids)
        chain = zlib.crc32(adapter.encode()) if adapter else 0
        for i in range((len(tokens) - 1) // block_size):
            chain = hash((chain, *tokens[i * block_size:(i + 1) * block_size])) & CHAIN_MASK
            self.chains.add(chain)
            self.num_blocks += 1

    def summary(self) -> tuple[int, np.ndarray]:
        """(cacheable blocks, the distinct chains as uint64): what the shard reports."""
        return self.num_blocks, np.fromiter(self.chains, np.uint64, len(self.chains))


def merge_pieces(summaries: list[tuple[int, np.ndarray]]) -> tuple[int, np.ndarray]:
    """The chain summaries of a shard's pieces as one."""
    blocks = sum(n for n, _ in summaries)
    chains = [c for _, c in summaries if len(c)]
    return blocks, np.unique(np.concatenate(chains)) if chains else np.zeros(0, np.uint64)
