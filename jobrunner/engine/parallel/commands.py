"""What the leader sends each step, and the divergence guard.

A step's message is one list of :class:`Command` (requests added since the last step, or a control word:
``close``, ``rebuild``, ``replace``, ``idle``) pickled once over the gloo object group. Requests travel as token
ids (the leader tokenized them) with their params and the seed the leader drew, so a follower needs no
tokenizer and its own seed stream never matters.

The guard: after every rank schedules a step, each all-reduces a fingerprint of what it scheduled (the rows'
ids, positions and token counts, and the last token of each row, so a sampling divergence shows one step later)
with MIN and MAX. Unequal fingerprints raise :class:`ParallelDivergence` on every rank, before the model's
collectives could see mismatched shapes and hang.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from jobrunner.engine.scheduler import SchedulerOutput

CONTROL_WORDS = ("close", "rebuild", "replace", "idle")


class ParallelDivergence(RuntimeError):
    """The ranks of a tensor-parallel group scheduled different steps (raised on every rank)."""


@dataclass(frozen=True)
class AddRequest:
    """``LLMEngine.add_request`` with the prompt as token ids (and the seed resolved by the leader)."""

    request_id: str
    token_ids: list[int]
    params: Any                      # SamplingParams | PoolingParams
    adapter: str | None = None
    arrival_time: float | None = None


@dataclass(frozen=True)
class Control:
    """A control word: ``close`` (followers return), ``rebuild`` (a fresh engine over the same weights),
    ``replace`` (a new engine from ``options["build"]``), ``idle`` (a keep-alive)."""

    word: str
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.word not in CONTROL_WORDS:
            raise ValueError(f"unknown control word {self.word!r} (one of {', '.join(CONTROL_WORDS)})")


Command = AddRequest | Control


def fingerprint(sched: SchedulerOutput) -> int:
    """A 62-bit digest of a scheduled step: every row's key, start, new tokens, drafts and last token."""
    digest = hashlib.blake2b(digest_size=8)
    for s in sched.scheduled:
        r = s.request
        last = r.output_token_ids[-1] if r.output_token_ids else -1
        digest.update(repr((r.key, s.start, s.num_new_tokens, len(s.draft), last)).encode())
    digest.update(repr([r.key for r in sched.preempted]).encode())
    return int.from_bytes(digest.digest(), "little") >> 2


def check_agreement(value: int, group: Any, what: str) -> None:
    """All-reduce ``value`` with MIN and MAX over ``group`` (one MAX of ``[v, -v]``); raise
    :class:`ParallelDivergence` naming ``what`` if the ranks disagree."""
    import torch.distributed as dist

    both = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = int(both[0]), -int(both[1])
    if high != low:
        raise ParallelDivergence(f"tensor-parallel ranks diverged: {what} differs across ranks "
                                 f"(min {low}, max {high}, rank {dist.get_rank()} has {value})")


def agree_min(value: int, group: Any) -> int:
    """The smallest ``value`` over the ranks of ``group`` (e.g. the KV blocks every rank can hold)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t[0])


def broadcast_commands(commands: list[Command] | None, group: Any) -> list[Command]:
    """Rank 0 sends ``commands``; every other rank receives them (pass None). One pickled object per step."""
    import torch.distributed as dist

    box = [commands]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
