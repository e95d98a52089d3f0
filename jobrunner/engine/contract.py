"""The worker engine contract: what a jobrunner worker needs from an engine (ours, another backend behind an
adapter, a test double), as a :class:`typing.Protocol`. The worker reads engines only through it; an engine
built by ``engine.factory`` that lacks a member is refused at the worker's load, naming what is missing.
docs/contracts.md says what each member means."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from jobrunner.engine.pooling import PoolingParams
from jobrunner.engine.request import RequestOutput
from jobrunner.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


class EngineStopped(RuntimeError):
    """Raised by ``step()`` when the engine will take no more requests because of a limit the user set (an
    endpoint's ``cost.max_usd``): the requests in flight have finished; the worker hands its unfinished shards
    back uncharged and the driver ends the run, resumable (docs/endpoints.md)."""


class EngineStatsLike(Protocol):
    """Counters of an engine since it was built: ``to_dict()`` gives plain values (docs/contracts.md)."""

    def to_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class WorkerEngine(Protocol):
    """What the worker needs from an engine.

    ``model_info``: what was loaded (source, architecture, dtype, head, pooling, ...; ``{}`` if nothing is
    known); ``tokenizer``: a transformers tokenizer, or None (the reasoning and tool-call parsers need one);
    ``device``: where it runs; ``block_size``: its KV block size in tokens (prefix-aware sharding's chains);
    ``num_unfinished_requests``: requests added and not yet handed back.
    """

    model_info: dict[str, Any]
    tokenizer: Any
    device: Any

    @property
    def block_size(self) -> int: ...

    @property
    def num_unfinished_requests(self) -> int: ...

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams | None = None,
                    *, chat_template_kwargs: dict[str, Any] | None = None, adapter: str | None = None) -> None:
        """Queue one request (``params.n`` samples). Bad content never raises: it comes back from ``step``
        with ``finish_reason="error"``; a duplicate id or an invalid structured-output spec raises
        ``ValueError`` (nothing queued)."""

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests (samples) that finished in it."""

    def has_unfinished_requests(self) -> bool:
        """Whether any request added is not handed back yet."""

    def stats(self) -> EngineStatsLike:
        """The engine's counters (steps, prefill/decode seconds and tokens, cached tokens, KV blocks...)."""

    def rebuild(self) -> WorkerEngine:
        """A fresh engine over the same weights (empty queues, a new KV cache) after this one failed; raise
        ``NotImplementedError`` if it cannot (the worker then builds one anew, loading the model again)."""

    def close(self) -> None:
        """Let go of what the engine holds (KV cache, threads); it is not used afterwards."""


def missing_members(engine: Any) -> list[str]:
    """The contract's members ``engine`` lacks (empty when it meets the contract)."""
    names = ["model_info", "tokenizer", "device", "block_size", "num_unfinished_requests", "add_request", "step",
             "has_unfinished_requests", "stats", "rebuild", "close"]
    missing = [n for n in names if not hasattr(engine, n)]
    methods = ("add_request", "step", "has_unfinished_requests", "stats", "rebuild", "close")
    missing += [f"{n} (not callable)" for n in methods if n not in missing and not callable(getattr(engine, n))]
    if "model_info" not in missing and not isinstance(engine.model_info, dict):
        missing.append("model_info (not a dict)")
    return missing


def check_worker_engine(engine: Any, where: str) -> None:
    """Raise ``TypeError`` naming what ``engine`` (built by ``where``) lacks of the contract."""
    missing = missing_members(engine)
    if missing:
        raise TypeError(f"{where} returned a {type(engine).__name__} that does not meet the worker engine "
                        f"contract (jobrunner.engine.WorkerEngine, docs/contracts.md): missing "
                        f"{', '.join(missing)}")
