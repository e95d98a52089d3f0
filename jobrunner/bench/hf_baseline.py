"""The baseline: transformers' ``generate`` over static, left-padded batches of the same token ids."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from jobrunner.bench.result import RunResult, peak_memory, reset_peak_memory, sync

PILOT_BATCH_SIZES = (8, 16, 32)
PILOT_TOKENS = 8


@dataclass(frozen=True)
class Baseline:
    """A loaded Hugging Face model and how to stop: ``eos_ids`` (ignored when ``ignore_eos``)."""

    model: torch.nn.Module
    device: torch.device
    eos_ids: tuple[int, ...]
    pad_id: int


def cast_keeping_buffers(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype
                         ) -> torch.nn.Module:
    """``model`` (in place) on ``device`` with its parameters in ``dtype`` and its buffers as they were: a plain
    ``.to(bf16)`` also rounds rope's ``inv_freq`` buffer to bf16 and moves every rotary angle (~0.25 rad at
    position 64), so a transformers reference made that way is itself wrong."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model = model.to(device, dtype)
    for name, b in model.named_buffers():
        b.data = buffers[name].to(device)
    return model


def load_baseline(model_dir: str, dtype: torch.dtype, device: torch.device, eos_ids: Sequence[int]) -> Baseline:
    """``AutoModelForCausalLM.from_pretrained`` in ``dtype`` on ``device``; pad with the first EOS id, else 0."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    eos = tuple(int(t) for t in eos_ids)
    return Baseline(model, device, eos, eos[0] if eos else 0)


def left_pad(batch: Sequence[Sequence[int]], pad_id: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` [B, L], padded on the left."""
    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, tokens in enumerate(batch):
        ids[row, width - len(tokens):] = torch.tensor(list(tokens), dtype=torch.long)
        mask[row, width - len(tokens):] = 1
    return ids.to(device), mask.to(device)


def count_output_tokens(new_tokens: torch.Tensor, eos_ids: Sequence[int], ignore_eos: bool) -> list[int]:
    """Generated tokens per row: all of them with ``ignore_eos``, else up to and including the first EOS."""
    if ignore_eos or not eos_ids:
        return [new_tokens.shape[1]] * new_tokens.shape[0]
    is_eos = torch.isin(new_tokens, torch.tensor(list(eos_ids), device=new_tokens.device))
    counts = []
    for row in is_eos:
        hits = row.nonzero()
        counts.append(int(hits[0]) + 1 if len(hits) else new_tokens.shape[1])
    return counts


def generate_batch(base: Baseline, batch: Sequence[Sequence[int]], max_tokens: int, ignore_eos: bool) -> list[int]:
    """Greedy ``generate`` of one static batch; the output token count of each row."""
    from transformers import GenerationConfig

    input_ids, mask = left_pad(batch, base.pad_id, base.device)
    eos = None if ignore_eos or not base.eos_ids else list(base.eos_ids)
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens if ignore_eos else None,
                              do_sample=False, eos_token_id=eos, pad_token_id=base.pad_id)
    with torch.inference_mode():
        out = base.model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    return count_output_tokens(out[:, input_ids.shape[1]:], base.eos_ids, ignore_eos)


def warm_up(base: Baseline, token_ids: list[list[int]]) -> None:
    """One untimed two-token ``generate`` of the first prompt."""
    generate_batch(base, token_ids[:1], 2, True)


def pick_batch_size(base: Baseline, token_ids: list[list[int]], candidates: Sequence[int] = PILOT_BATCH_SIZES,
                    pilot_tokens: int = PILOT_TOKENS) -> tuple[int, dict[int, float]]:
    """The candidate with the best output tokens/s on one pilot batch each (the first prompts, few tokens).

    Candidates are capped at the number of prompts; the first pilot also warms the model up.
    """
    sizes = sorted({min(c, len(token_ids)) for c in candidates})
    warm_up(base, token_ids)
    if len(sizes) == 1:
        return sizes[0], {}
    rates: dict[int, float] = {}
    for size in sizes:
        sync(base.device)
        start = time.perf_counter()
        counts = generate_batch(base, token_ids[:size], pilot_tokens, True)
        sync(base.device)
        rates[size] = sum(counts) / (time.perf_counter() - start)
    return max(rates, key=rates.__getitem__), rates


def run_baseline(base: Baseline, token_ids: list[list[int]], max_tokens: int, ignore_eos: bool,
                 batch_size: int) -> RunResult:
    """All prompts in order, ``batch_size`` at a time; timed from the first batch to the last output."""
    reset_peak_memory(base.device)
    sync(base.device)
    start = time.perf_counter()
    counts: list[int] = []
    for i in range(0, len(token_ids), batch_size):
        counts += generate_batch(base, token_ids[i:i + batch_size], max_tokens, ignore_eos)
    sync(base.device)
    seconds = time.perf_counter() - start
    return RunResult(name="hf", seconds=seconds, num_requests=len(token_ids),
                     num_prompt_tokens=sum(len(ids) for ids in token_ids), num_cached_tokens=0,
                     num_output_tokens=sum(counts), memory=peak_memory(base.device),
                     extra={"batch_size": batch_size})
