"""Rank 0 of a tensor-parallel group: the engine the worker talks to (``jobrunner.engine.WorkerEngine``).

``add_request`` checks what would raise (duplicate id, bad structured-output spec) and tokenizes on the leader,
then records an :class:`~jobrunner.engine.parallel.commands.AddRequest`; nothing is sent yet. ``step`` sends
the recorded commands once, every rank applies them in the same order (a request's prompt scoring runs the
model, so it must run on every rank at the same point), and every rank runs the same step. A prompt that
cannot be tokenized finishes with an error on the leader only (it never reaches a scheduler).

Between steps a keep-alive thread sends ``idle`` when no step was sent for a quarter of the timeout, so a
worker waiting for its next shard does not time its followers out. After a collective fails the group is
*broken*: ``close`` then tears down locally without sending, ``rebuild`` raises ``NotImplementedError`` (the
worker starts a new group).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jobrunner.engine.parallel.commands import AddRequest, Command, Control, broadcast_commands
from jobrunner.engine.parallel.group import leave_group, object_group
from jobrunner.engine.pooling import PoolingParams
from jobrunner.engine.request import RequestOutput
from jobrunner.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jobrunner.models.parallel import TensorParallel


class ParallelEngine:
    """The leader's engine (rank 0) over its :class:`LLMEngine`; ``on_close`` runs after the group is left
    (e.g. :func:`~jobrunner.engine.parallel.spawn_local` joins its follower processes there)."""

    def __init__(self, engine: Any, tp: TensorParallel, timeout_s: float = 600.0,
                 on_close: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.tp = tp
        self.timeout_s = timeout_s
        self._on_close = on_close
        self.processes: list[Any] = []           # follower processes this process started (spawn_local)
        self._pending: list[Command] = []
        self._pending_ids: dict[str, int] = {}   # request id -> samples, recorded and not yet sent
        self._lock = threading.Lock()            # one collective sequence at a time (steps vs keep-alive)
        self._last_sent = time.monotonic()
        self._broken: BaseException | None = None
        self._closed = threading.Event()         # set: the keep-alive stops (closed, or handed to a successor)
        self._done = False                       # closed, or replaced by a rebuilt / replaced engine
        self._keepalive = threading.Thread(target=self._keep_alive, name="tp-keepalive", daemon=True)
        self._keepalive.start()

    # -- the worker engine contract ----------------------------------------------------------------------------

    @property
    def model_info(self) -> dict[str, Any]:
        return self.engine.model_info

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def device(self) -> Any:
        return self.engine.device

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    @property
    def num_unfinished_requests(self) -> int:
        return self.engine.num_unfinished_requests + sum(self._pending_ids.values())

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending_ids) or self.engine.has_unfinished_requests()

    def stats(self) -> Any:
        return self.engine.stats()

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams | None = None,
                    *, chat_template_kwargs: dict[str, Any] | None = None, adapter: str | None = None) -> None:
        """As ``LLMEngine.add_request``; the request reaches every rank with the next ``step``."""
        engine = self.engine
        if request_id in self._pending_ids or request_id in engine._request_ids:
            raise ValueError(f"duplicate request id {request_id!r}")
        sampling = params if isinstance(params, SamplingParams) else SamplingParams()
        engine._grammar_factory(sampling)  # raises ValueError on a bad spec, before anything is recorded
        params = self._with_seed(params)
        now = time.perf_counter()
        try:
            token_ids = engine.tokenize(prompt, chat_template_kwargs)
            params = self._completion_as_ids(params)
        except Exception:  # noqa: BLE001 - the leader's add_request turns it into that request's error
            engine.add_request(request_id, prompt, params, chat_template_kwargs=chat_template_kwargs,
                               adapter=adapter)
            return
        self._pending.append(AddRequest(request_id, token_ids, params, adapter, now))
        self._pending_ids[request_id] = sampling.n if not isinstance(params, PoolingParams) else 1

    def step(self) -> list[RequestOutput]:
        """Send the recorded commands (once), apply them on every rank, then run the same step everywhere."""
        with self._lock:
            commands, self._pending, self._pending_ids = self._pending, [], {}
            self._send(commands)
            apply_commands(self.engine, commands)
            return self._collective(self.engine.step)

    def rebuild(self) -> ParallelEngine:
        """Every rank builds a fresh engine over its weights (empty queues, a new KV cache); this one is not
        used afterwards. ``NotImplementedError`` once the group is broken (a rank is lost)."""
        if self._broken is not None:
            raise NotImplementedError(f"the tensor-parallel group is broken ({self._broken}); start a new one")
        with self._lock:
            self._pending, self._pending_ids = [], {}
            self._send([Control("rebuild")])
            engine = self._collective(self.engine.rebuild)
            self._retire()
        return self._successor(engine)

    def replace(self, build: Callable[[TensorParallel], Any]) -> ParallelEngine:
        """Every rank closes its engine and builds a new one with ``build(tp)`` (another model, other
        settings) over the same group, without starting new processes; this one is not used afterwards.
        ``build`` travels pickled to the followers."""
        with self._lock:
            self._pending, self._pending_ids = [], {}
            self._send([Control("replace", {"build": build})])
            self.engine.close()
            self.engine = None
            engine = self._collective(build, self.tp)
            self._retire()
        return self._successor(engine)

    def close(self) -> None:
        """Tell the followers to close (unless the group is broken), close this engine, leave the group."""
        if self._done:
            return
        self._done = True
        self._closed.set()
        try:
            if self._broken is None:
                with self._lock:
                    self._send([Control("close")])
        except Exception:  # noqa: BLE001 - a lost follower: nothing to tell; tear down locally
            pass
        finally:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
            leave_group()
            if self._on_close is not None:
                self._on_close()

    # -- beyond the contract -----------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Any], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion over the group; outputs in input order (as ``LLMEngine.generate``; no
        progress bar)."""
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        ids = [f"gen-{id(prompts)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.add_request(request_id, prompt, p)
        outputs = {}
        while self.has_unfinished_requests():
            for out in self.step():
                outputs[(out.request_id, out.sample_index)] = out
        order = {request_id: i for i, request_id in enumerate(ids)}
        return [outputs[key] for key in sorted(outputs, key=lambda key: (order[key[0]], key[1]))]

    def prompt_logprobs(self, prompt: Any, adapter: str | None = None) -> list[float]:
        """Not with tensor parallel: it runs the model on the leader alone, outside a step (use
        ``SamplingParams(prompt_logprobs=...)``, which every rank runs at the same point)."""
        raise NotImplementedError("prompt_logprobs() runs the model on one rank; with tensor_parallel_size > 1 ask "
                                  "for SamplingParams(prompt_logprobs=k) on the request instead")

    def __getattr__(self, name: str) -> Any:
        # read-only views of the leader's engine (config, max_model_len, memory_plan, model, runner, ...); what
        # runs the model goes through step() on every rank, never through these
        if name.startswith("__") or name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # -- internals ---------------------------------------------------------------------------------------------

    def _with_seed(self, params: Any) -> Any:
        """Sampling params with the seed the leader's engine would draw (the followers' streams never count)."""
        if isinstance(params, PoolingParams):
            return params
        params = params or SamplingParams()
        if params.seed is not None:
            return params
        return dataclasses.replace(params, seed=self.engine._seeds.getrandbits(63))

    def _completion_as_ids(self, params: Any) -> Any:
        """A scored completion given as text becomes token ids here (followers need no tokenizer)."""
        if isinstance(params, PoolingParams) and isinstance(params.completion, str) and params.completion:
            return dataclasses.replace(params, completion=self.engine._completion_ids(params.completion))
        return params

    def _successor(self, engine: Any) -> ParallelEngine:
        """The wrapper of this group's next engine (it owns the processes and the close hook now)."""
        successor = ParallelEngine(engine, self.tp, self.timeout_s, self._on_close)
        successor.processes = self.processes
        return successor

    def _retire(self) -> None:
        """A successor wrapper owns the group now: this one's keep-alive stops and its close does nothing."""
        self._done = True
        self._closed.set()
        self.engine = None

    def _send(self, commands: list[Command]) -> None:
        self._collective(broadcast_commands, commands, object_group(self.tp))
        self._last_sent = time.monotonic()

    def _collective(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn``; a failure (a lost rank, a divergence) marks the group broken and is raised."""
        if self._broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken: {self._broken}")
        try:
            return fn(*args)
        except BaseException as exc:
            self._broken = exc
            raise

    def _keep_alive(self) -> None:
        """Send ``idle`` when nothing was sent for a quarter of the timeout (followers wait in a collective)."""
        period = self.timeout_s / 4
        while not self._closed.wait(min(period, 5.0)):
            if time.monotonic() - self._last_sent < period or self._broken is not None:
                continue
            if self._lock.acquire(blocking=False):
                try:
                    if not self._closed.is_set():
                        self._send([Control("idle")])
                except Exception:  # noqa: BLE001 - recorded as broken; the next step raises it
                    pass
                finally:
                    self._lock.release()


def apply_commands(engine: Any, commands: list[Command]) -> None:
    """Apply the requests of one step's commands to a rank's engine, in order (control words are the
    caller's)."""
    for c in commands:
        if isinstance(c, AddRequest):
            engine.add_request(c.request_id, c.token_ids, c.params, adapter=c.adapter,
                               arrival_time=c.arrival_time)
