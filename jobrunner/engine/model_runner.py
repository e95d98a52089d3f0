"""Turns a SchedulerOutput into tensors, runs the model over the paged KV cache, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jobrunner.engine.attention import AttentionGroup, AttentionMetadata
from jobrunner.engine.decode_graphs import DecodeGraphs, DecodeRow
from jobrunner.engine.sampler import Sampler
from jobrunner.engine.sampling.logprobs import LogprobEntry
from jobrunner.engine.scheduler import ScheduledRequest, SchedulerOutput

MAX_DECODE_GROUP = 32     # decodes of similar context length attended together in one padded call
MAX_PADDING_WASTE = 0.5   # start a new group rather than pad the keys gathered by more than this share


@dataclass
class StepResult:
    sampled: dict[tuple[str, int], int]            # Request.key -> new token (rows that reached their end)
    logprobs: dict[tuple[str, int], LogprobEntry]  # Request.key -> (token, logprob, top alternatives), if asked
    num_prefill_tokens: int
    num_decode_tokens: int
    fixed_shape: bool = False          # ran through DecodeGraphs (a CUDA graph replay, or its eager twin)


class ModelRunner:
    """Owns the model and the KV cache tensor ``[num_layers, 2, num_slots, kv_heads, head_dim]``.

    ``decode_graphs``: ``"off"``; ``"cuda"`` (decode-only steps replay CUDA graphs, see
    :mod:`jobrunner.engine.decode_graphs`); ``"static"`` (the same fixed-shape decode path run eagerly, on any
    device: for tests). With either of the last two the cache holds one scratch block past ``num_blocks``.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, device: torch.device,
                 seed: int = 0, decode_graphs: str = "off", max_batch: int = 1, max_model_len: int = 1) -> None:
        if decode_graphs not in ("off", "cuda", "static"):
            raise ValueError(f"decode_graphs must be off|cuda|static, got {decode_graphs!r}")
        self.model = model
        self.device = device
        self.block_size = block_size
        s = model.shape
        self.n_rep = s.num_heads // s.num_kv_heads
        dtype = model.dtype
        total_blocks = num_blocks + (decode_graphs != "off")
        # zeros, not empty: padded keys are masked, but NaN garbage would still poison 0 * NaN
        self.kv_cache = torch.zeros(s.num_layers, 2, total_blocks * block_size, s.num_kv_heads, s.head_dim,
                                    dtype=dtype, device=device)
        self.sampler = Sampler(device, seed)
        self.graphs = None
        if decode_graphs != "off":
            self.graphs = DecodeGraphs(model, self.kv_cache, block_size, max_batch, max_model_len,
                                       scratch_block=num_blocks, capture=decode_graphs == "cuda")

    @staticmethod
    def bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
        s = model.shape
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return s.num_layers * 2 * block_size * s.num_kv_heads * s.head_dim * itemsize

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        fixed = self._run_fixed_shape(sched.scheduled) if self.graphs is not None else None
        if fixed is not None:
            hidden, sample_rows, sampling = fixed
        else:
            input_ids, positions, meta, sample_rows, sampling = self._prepare(sched.scheduled)
            hidden = self.model(input_ids, positions, meta, self.kv_cache)
        sampled, logprobs = self._sample(hidden, sample_rows, sampling)
        num_decode = sum(1 for s in sched.scheduled if _is_decode(s))
        return StepResult(sampled, logprobs, sched.num_tokens - num_decode, num_decode, fixed is not None)

    # -- sampling (owned by the sampler side: engine/sampler.py) ------------------------------------------------

    def _sample(self, hidden: torch.Tensor, sample_rows: torch.Tensor, sampling: list[ScheduledRequest]
                ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], LogprobEntry]]:
        """New tokens (and logprob entries where asked) keyed by ``Request.key``."""
        if not sampling:
            return {}, {}
        logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
        requests = [s.request for s in sampling]
        out = self.sampler.sample(logits, requests)
        sampled = {r.key: t for r, t in zip(requests, out.token_ids)}
        logprobs = {r.key: e for r, e in zip(requests, out.logprobs) if e is not None}
        return sampled, logprobs

    def _run_fixed_shape(self, scheduled: list[ScheduledRequest]):
        """A step of single-token rows through DecodeGraphs; None when it has a chunk or doesn't fit a shape."""
        if any(s.num_new_tokens != 1 for s in scheduled):
            return None
        bs = self.block_size
        rows = []
        for s in scheduled:
            req, p = s.request, s.start
            past_prompt = p - req.num_prompt_tokens
            token = req.output_token_ids[past_prompt] if past_prompt >= 0 else req.prompt_token_ids[p]
            table = req.block_ids
            rows.append(DecodeRow(token, p, table[p // bs] * bs + p % bs, table[:p // bs + 1]))
        shape = self.graphs.shape_for(rows)
        if shape is None:
            return None
        hidden = self.graphs.run(rows, shape)
        sampling = [s for s in scheduled if s.samples]
        sample_rows = torch.tensor([i for i, s in enumerate(scheduled) if s.samples], device=self.device)
        return hidden, sample_rows, sampling

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
        meta = AttentionMetadata(torch.tensor(slots, device=dev), groups, len(input_ids), bs)
        return (torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev),
                meta, torch.tensor(sample_rows, device=dev), sampling)

    def _block_table(self, s: ScheduledRequest, num_blocks: int) -> list[int]:
        table = s.request.block_ids[:num_blocks]
        return table + [0] * (num_blocks - len(table))  # padding blocks are masked out

    def _chunk_group(self, s: ScheduledRequest, offset: int) -> AttentionGroup:
        # One request computing Q tokens at positions start..start+Q-1, attending to keys 0..start+Q-1.
        q_len, kv_len = s.num_new_tokens, s.start + s.num_new_tokens
        num_blocks = -(-kv_len // self.block_size)
        index = torch.arange(offset, offset + q_len, device=self.device)
        blocks = torch.tensor(self._block_table(s, num_blocks), device=self.device)
        padded_len = num_blocks * self.block_size
        if s.start == 0:
            return AttentionGroup(1, q_len, padded_len, index, blocks, None, index, causal=True)
        rows = torch.arange(q_len)[:, None] + s.start
        mask = torch.arange(padded_len)[None, :] <= rows      # [Q, L] causal with offset
        mask = mask.repeat(self.n_rep, 1)[None, None]          # [1, 1, n_rep * Q, L]
        return AttentionGroup(1, q_len, padded_len, index, blocks, mask.to(self.device), index)

    def _decode_groups(self, decodes: list[tuple[int, int, ScheduledRequest]]) -> list[AttentionGroup]:
        groups = []
        bs = self.block_size
        for chunk in _pack_by_length(decodes, bs):
            lengths = [d[0] for d in chunk]
            num_blocks = -(-lengths[-1] // bs)
            tables = [self._block_table(s, num_blocks) for _, _, s in chunk]
            valid = torch.arange(num_blocks * bs)[None, :] < torch.tensor(lengths)[:, None]   # [G, L]
            mask = valid[:, None, None, :].to(self.device)                                   # [G, 1, 1, L]
            index = torch.tensor([d[1] for d in chunk], device=self.device)
            blocks = torch.tensor(tables, device=self.device).flatten()
            groups.append(AttentionGroup(len(chunk), 1, num_blocks * bs, index, blocks, mask, index))
        return groups


def _pack_by_length(decodes: list[tuple[int, int, ScheduledRequest]], block_size: int):
    """Sort decodes by context length and cut them into groups whose padding stays small.

    Every member of a group is padded to the group's longest context, so one long request in a group of
    short ones would multiply the keys gathered; a group closes when padding would pass MAX_PADDING_WASTE.
    """
    decodes = sorted(decodes, key=lambda d: d[0])
    group: list = []
    total = 0
    for d in decodes:
        padded = len(group) + 1
        blocks = -(-d[0] // block_size) * block_size
        if group and (padded > MAX_DECODE_GROUP or padded * blocks > (1 + MAX_PADDING_WASTE) * (total + d[0])):
            yield group
            group, total = [], 0
        group.append(d)
        total += d[0]
    if group:
        yield group


def _is_decode(s: ScheduledRequest) -> bool:
    return s.num_new_tokens == 1 and s.start >= s.request.num_prompt_tokens
