"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobrunner.engine.attention import AttentionGroup, AttentionMetadata
from jobrunner.engine.sampler import Sampler
from jobrunner.engine.scheduler import ScheduledRequest, SchedulerOutput

DECODE_GROUP_SIZE = 32  # decodes of similar context length attended together in one padded call


@dataclass
class StepResult:
    sampled: dict[str, int]            # request_id -> new token (only requests that reached their end)
    logprobs: dict[str, float]
    num_prefill_tokens: int
    num_decode_tokens: int


class ModelRunner:
    """Owns the model and the KV cache tensor ``[num_layers, 2, num_blocks * block_size, kv_heads, head_dim]``."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device,
                 seed: int = 0) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        s = model.shape
        self.n_rep = s.num_heads // s.num_kv_heads
        dtype = model.embed_tokens.weight.dtype
        # zeros, not empty: padded keys are masked, but NaN garbage would still poison 0 * NaN
        self.kv_cache = torch.zeros(s.num_layers, 2, num_blocks * block_size, s.num_kv_heads, s.head_dim,
                                    dtype=dtype, device=device)
        self.sampler = Sampler(device, seed)

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        s = model.shape
        return s.num_layers * 2 * block_size * s.num_kv_heads * s.head_dim * torch.tensor([], dtype=dtype).element_size()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        input_ids, positions, slots, meta, sample_rows, sampling = self._prepare(sched.scheduled)
        hidden = self.model(input_ids, positions, meta, self.kv_cache)
        sampled, logprobs = {}, {}
        if sampling:
            logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
            requests = [s.request for s in sampling]
            want = any(r.params.logprobs for r in requests)
            tokens, lps = self.sampler.sample(logits, [r.params for r in requests],
                                              [r.num_output_tokens for r in requests], want)
            for i, r in enumerate(requests):
                sampled[r.request_id] = tokens[i]
                if lps is not None:
                    logprobs[r.request_id] = lps[i]
        num_decode = sum(1 for s in sched.scheduled if _is_decode(s))
        return StepResult(sampled, logprobs, sched.num_tokens - num_decode, num_decode)

    def _prepare(self, scheduled: list[ScheduledRequest]):
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        groups: list[AttentionGroup] = []
        decodes: list[tuple[int, int, ScheduledRequest]] = []  # (context_len, token_index, s)
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        bs = self.block_size
        for s in scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            offset = len(input_ids)
            if n == 1 and start >= req.num_prompt_tokens:
                input_ids.append(req.output_token_ids[start - req.num_prompt_tokens])
            else:
                input_ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decodes.append((start + 1, offset, s))
            else:
                groups.append(self._chunk_group(s, offset))
            if s.samples:
                sample_rows.append(offset + n - 1)
                sampling.append(s)
        groups.extend(self._decode_groups(decodes))
        dev = self.device
        meta = AttentionMetadata(torch.tensor(slots, device=dev), groups, len(input_ids))
        return (torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev),
                slots, meta, torch.tensor(sample_rows, device=dev), sampling)

    def _context_slots(self, s: ScheduledRequest, length: int) -> torch.Tensor:
        table = torch.tensor(s.request.block_ids[: -(-length // self.block_size)], dtype=torch.long)
        all_slots = (table[:, None] * self.block_size + torch.arange(self.block_size)).flatten()
        return all_slots[:length]

    def _chunk_group(self, s: ScheduledRequest, offset: int) -> AttentionGroup:
        # One request computing Q tokens at positions start..start+Q-1, attending to keys 0..start+Q-1.
        q_len, kv_len = s.num_new_tokens, s.start + s.num_new_tokens
        rows = torch.arange(q_len)[:, None] + s.start
        mask = torch.arange(kv_len)[None, :] <= rows               # [Q, L] causal with offset
        mask = mask.repeat(self.n_rep, 1)[None, None]              # [1, 1, n_rep * Q, L]
        index = torch.arange(offset, offset + q_len, device=self.device)
        return AttentionGroup(1, q_len, kv_len, index, self._context_slots(s, kv_len).to(self.device),
                              mask.to(self.device), None, index)

    def _decode_groups(self, decodes: list[tuple[int, int, ScheduledRequest]]) -> list[AttentionGroup]:
        decodes.sort(key=lambda d: d[0])
        groups = []
        for i in range(0, len(decodes), DECODE_GROUP_SIZE):
            chunk = decodes[i:i + DECODE_GROUP_SIZE]
            lengths = [d[0] for d in chunk]
            max_len = lengths[-1]
            kv_slots = torch.zeros(len(chunk), max_len, dtype=torch.long)
            for row, (length, _, s) in enumerate(chunk):
                kv_slots[row, :length] = self._context_slots(s, length)
            mask = None
            if lengths[0] != max_len:
                valid = torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]   # [G, L]
                mask = valid[:, None, None, :].to(self.device)                            # [G, 1, 1, L]
            index = torch.tensor([d[1] for d in chunk], device=self.device)
            groups.append(AttentionGroup(len(chunk), 1, max_len, index, kv_slots.flatten().to(self.device),
                                         mask, None, index))
        return groups


def _is_decode(s: ScheduledRequest) -> bool:
    return s.num_new_tokens == 1 and s.start >= s.request.num_prompt_tokens
