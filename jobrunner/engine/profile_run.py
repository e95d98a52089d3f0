"""The profile step that measures a step's activation peak before the KV cache is sized (engine/memory_plan.py).

It runs through the engine's own scheduler and model runner, on a throw-away KV cache with just the blocks the
step needs and no CUDA graphs: ``max_num_batched_tokens`` prompt tokens over up to ``max_num_seqs`` requests,
each finishing its prompt in this step so the sampler sees ``max_num_seqs`` rows of logits. On CUDA the peak is
``torch.cuda.max_memory_allocated`` above what was allocated before the step (weights and that small cache);
on CPU the step runs (tests hold that it does) and nothing is measured.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from jobrunner.engine.config import EngineConfig
from jobrunner.engine.memory_plan import profile_lengths


@dataclass(frozen=True)
class ProfileResult:
    """What the profile step ran and measured."""

    peak_bytes: int  # device memory above what was allocated before the step (0 off CUDA)
    num_tokens: int  # tokens the step computed (max_num_batched_tokens)
    num_sampled: int  # rows the sampler drew a token for (up to max_num_seqs)


def profile_step(model: torch.nn.Module, config: EngineConfig, device: torch.device,
                 max_model_len: int) -> ProfileResult:
    """Run one worst-case step and measure it (see the module docstring). Frees what it made."""
    from jobrunner.engine.kv_cache.manager import KVCacheManager
    from jobrunner.engine.model_runner import ModelRunner
    from jobrunner.engine.request import Request
    from jobrunner.engine.sampling_params import SamplingParams
    from jobrunner.engine.scheduler import Scheduler

    lengths = profile_lengths(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)
    bs = config.block_size
    num_blocks = sum(math.ceil((n + 1) / bs) for n in lengths) + 1
    cfg = dataclasses.replace(config, enable_prefix_caching=False, max_num_seqs=len(lengths),
                              num_kv_blocks=num_blocks, speculative="off")
    scheduler = Scheduler(cfg, KVCacheManager(num_blocks, bs, False))
    runner = ModelRunner(model, cfg, num_blocks, device, max_model_len)
    vocab = model.shape.vocab_size
    now = time.perf_counter()
    for i, n in enumerate(lengths):
        token_ids = [(i + j) % vocab for j in range(n)]
        scheduler.add(Request(f"profile-{i}", token_ids, SamplingParams(max_tokens=1), now, (), seed=i))
    sched = scheduler.schedule()
    is_cuda = device.type == "cuda"
    if is_cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    result = runner.execute(sched)
    peak = 0
    if is_cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    done = ProfileResult(peak, sched.num_tokens, len(result.sampled))
    del runner, scheduler, sched, result
    return done
