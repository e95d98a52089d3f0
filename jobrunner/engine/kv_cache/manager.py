"""KV cache policy over the block pool: prefix lookups, slot allocation, freeing."""

from __future__ import annotations

from jobrunner.engine.kv_cache.block_pool import BlockPool, hash_block
from jobrunner.engine.request import Request


class KVCacheManager:
    """Decides which blocks a request gets; the pool only stores the bookkeeping."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks of the longest cached prefix of ``request`` (full blocks only, never the last token).

        The last token is always recomputed so the step that finishes the prompt produces logits; a
        prefill-only request also recomputes every position it reads (``first_needed_position``, e.g. all of
        them for mean pooling).
        """
        if not self.enable_prefix_caching:
            return []
        token_ids = request.all_token_ids
        num_full = min(len(token_ids) - 1, request.first_needed_position) // self.block_size
        self._extend_hashes(request, token_ids, num_full)
        block_ids = []
        for i in range(num_full):
            chunk = self._block_key(request, token_ids, i)
            block_id = self.pool.lookup(request.block_hashes[i], chunk)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_block_ids: list[int] = (),
                       num_lookahead_tokens: int = 0) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens (after any cached prefix).

        ``num_lookahead_tokens``: slots for speculative (draft) tokens after them; blocks holding drafts are
        never registered in the prefix cache (only blocks full of known tokens are). Returns False, changing
        nothing, when there is no room.
        """
        cached_block_ids = list(cached_block_ids)
        num_reused_free = sum(1 for b in cached_block_ids if self.pool.blocks[b].ref_cnt == 0)
        num_computed = request.num_computed_tokens + len(cached_block_ids) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens + num_lookahead_tokens)
        num_new_blocks = num_needed - len(request.block_ids) - len(cached_block_ids)
        if num_new_blocks + num_reused_free > self.pool.num_free_blocks:
            return False
        if cached_block_ids:
            self.pool.touch(cached_block_ids)
            request.block_ids.extend(cached_block_ids)
            request.num_cached_blocks = len(request.block_ids)
        if num_new_blocks > 0:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return True

    def register_computed(self, request: Request) -> None:
        """Register the request's full blocks of computed, known tokens in the prefix cache (late readback: a block
        filled by a token read one step late is registered once the token is known)."""
        self._cache_full_blocks(request, request.num_computed_tokens)

    def fork(self, request: Request, num_prompt_tokens: int) -> list[int]:
        """The blocks of ``request`` that sibling samples can share: the full prompt blocks.

        Never the block holding the last prompt token: each sample recomputes that token (and the partial
        block's few tokens) in its own block, so its first token gets its own logits and no block is ever
        written by two requests (no copy-on-write needed).
        """
        return request.block_ids[:(num_prompt_tokens - 1) // self.block_size]

    def adopt(self, request: Request, shared_block_ids: list[int]) -> None:
        """Give a waiting ``request`` one reference on each shared block; it starts after them."""
        self.pool.touch(shared_block_ids)
        request.block_ids = list(shared_block_ids)
        request.num_cached_blocks = len(shared_block_ids) if self.enable_prefix_caching else 0
        request.num_computed_tokens = len(shared_block_ids) * self.block_size

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those ``num_tokens`` tokens need (slots of rejected draft tokens)."""
        keep = self.num_blocks_for(num_tokens)
        if len(request.block_ids) > keep:
            self.pool.free(list(reversed(request.block_ids[keep:])))
            del request.block_ids[keep:]
            request.num_cached_blocks = min(request.num_cached_blocks, keep)

    def free(self, request: Request) -> None:
        """Release a request's blocks (tail first, so the prefix head is evicted last)."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_cached_blocks = 0

    def _cache_full_blocks(self, request: Request, num_tokens_after_step: int) -> None:
        # Blocks that will be full once this step has run hold known tokens: register them now. A token still on
        # the device (late readback) is not known yet: its block is registered at the request's next allocation.
        if not self.enable_prefix_caching:
            return
        num_known = request.num_tokens - request.num_pending_tokens
        num_full = min(num_tokens_after_step, num_known) // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        token_ids = request.all_token_ids
        self._extend_hashes(request, token_ids, num_full)
        for i in range(request.num_cached_blocks, num_full):
            chunk = self._block_key(request, token_ids, i)
            self.pool.cache(request.block_ids[i], request.block_hashes[i], chunk)
        request.num_cached_blocks = num_full

    def _extend_hashes(self, request: Request, token_ids: list[int], num_full: int) -> None:
        hashes = request.block_hashes
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, self._block_key(request, token_ids, i)))

    def _block_key(self, request: Request, token_ids: list[int], i: int) -> tuple[int | str, ...]:
        """Block ``i``'s tokens, as hashed and confirmed; a block rotated with another rope table than the first
        (longrope's long one, engine/long_rope.py) leads with a negative marker no token id can equal, a block
        computed with a LoRA adapter with the adapter's marker (a string: equal to no token id nor rope marker),
        so rows of different adapters never share a block (their K/V differ from the first adapted layer on); a
        block holding image tokens with the digest of each image it covers (``image:<sha256>``, engine/vision.py),
        so the same text with a different image never shares a block."""
        chunk = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
        if request.images is not None:
            chunk = (*request.images.block_markers(i * self.block_size, (i + 1) * self.block_size), *chunk)
        if request.rope_table:
            chunk = (-request.rope_table, *chunk)
        return (f"adapter:{request.adapter_id}", *chunk) if request.adapter_id else chunk

    def check_integrity(self, live_requests: list[Request]) -> None:
        """Pool consistency plus: every block's ref count equals the number of live requests holding it."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for request in live_requests:
            for block_id in request.block_ids:
                holders[block_id] += 1
        for block in self.pool.blocks:
            if block.ref_cnt != holders[block.block_id]:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but {holders[block.block_id]} holders"
                )
