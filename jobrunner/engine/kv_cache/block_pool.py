"""The KV block pool: who owns which block, and which freed blocks still hold a reusable prefix.

Every block is either free (ref_cnt == 0, in the free queue) or referenced (ref_cnt > 0, not in the queue).
A full block may also carry a hash (the chain hash of its tokens and all tokens before it) and stay findable
through ``hash_to_block_id`` while it sits in the free queue; it loses its hash only when it is handed out
again. The free queue is LRU: freed blocks go to its back and ``allocate`` takes from its front, so the
longest-unused cached prefixes are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # kept to confirm a hash hit (a collision never corrupts output)


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chain hash of one full block: depends on this block's tokens and every token before it."""
    return hash((parent_hash, token_ids))


class BlockPool:
    """Owns the block bookkeeping (not the KV tensors themselves, which the model runner holds)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take ``num_blocks`` blocks from the front of the free queue; ``None`` if there is no room."""
        if num_blocks > len(self.free_block_ids):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_block_ids.popitem(last=False)
            block = self.blocks[block_id]
            self._drop_hash(block)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on cached blocks (a prefix-cache hit), pulling free ones off the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_block_ids[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks that reach zero go to the back of the free queue.

        Callers pass a request's blocks tail first, so a prefix's last blocks are evicted before its first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_ids[block_id] = None

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly these tokens after this chain, or ``None``."""
        block_id = self.hash_to_block_id.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def cache(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Register a full block under its chain hash (first writer wins on duplicates)."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.hash_to_block_id:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.hash_to_block_id[block_hash] = block_id

    def _drop_hash(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.hash_to_block_id.get(block.block_hash) == block.block_id:
                del self.hash_to_block_id[block.block_hash]
                self.num_evictions += 1
            block.block_hash = None
            block.token_ids = None

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (tests call this after every step)."""
        for block in self.blocks:
            in_queue = block.block_id in self.free_block_ids
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != in_queue:
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, in free queue {in_queue}")
        for block_hash, block_id in self.hash_to_block_id.items():
            block = self.blocks[block_id]
            if block.block_hash != block_hash or block.token_ids is None:
                raise AssertionError(f"hash map points at block {block_id} that does not hold that hash")
