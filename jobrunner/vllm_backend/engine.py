"""`engine.backend: vllm`: vLLM's engine as a worker engine (jobrunner.engine.WorkerEngine).

vLLM runs in its own process (``server.py``, started with the Python that has vLLM: it pins torch and
transformers versions of its own, so it usually lives in its own venv), one per worker. Prompts are made into
token ids here, with the model's tokenizer and the same rule as our engine (engine/prompt_tokens.py: chat
template, ``chat_template_kwargs``), so both backends see the same ids; vLLM samples and detokenizes. Per-row
metrics come from vLLM's own request timestamps (docs/driver.md, "vLLM backend").
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobrunner.engine.images import prompt_images
from jobrunner.engine.pooling import PoolingParams
from jobrunner.engine.prompt_tokens import text_or_chat_token_ids
from jobrunner.engine.request import RequestMetrics, RequestOutput, TokenLogprob, TopLogprob
from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.vllm_backend.images import count_image_tokens, image_payload, template_messages

SERVER = Path(__file__).with_name("server.py")
CLOSE_TIMEOUT_S = 30.0


class VllmError(RuntimeError):
    """vLLM's engine process failed (it died, or a step raised): the worker rebuilds or gives up."""


@dataclass
class VllmStats:
    """Counters since this engine started (what `stats()` hands the worker)."""

    steps: int = 0
    decode_s: float = 0.0  # vLLM does not split a step into prefill and decode: all step time is counted here
    prefill_s: float = 0.0
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_sampled_tokens: int = 0  # output tokens produced so far, finished requests or not (progress)
    num_images: int = 0  # images in finished requests' prompts
    num_image_tokens: int = 0  # of their prompt tokens, those vLLM gave the images' features
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        hit = self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
        return {**out, "prefix_cache_hit_rate": hit, **self.extra}


class VllmEngine:
    """The worker engine contract over one vLLM engine process."""

    def __init__(self, python: str, engine_args: dict[str, Any], tokenizer: Any, model_info: dict[str, Any],
                 chat_template: str | None = None, env: dict[str, str] | None = None,
                 log_path: str | None = None, device: str | None = None,
                 placement: dict[str, Any] | None = None) -> None:
        self.python, self.engine_args, self.tokenizer = python, dict(engine_args), tokenizer
        self.chat_template, self.env, self.log_path = chat_template, env, log_path
        self.model_info = dict(model_info)
        self.device = device or str(engine_args.get("device") or "cpu")  # vLLM's reply to start names its own
        self.block_size = int(engine_args.get("block_size") or 16)
        self._stats = VllmStats()
        self._pending: dict[str, tuple[float, int, SamplingParams]] = {}  # id -> (arrival, images, params)
        self._rejected: list[RequestOutput] = []
        self._proc = self._spawn()
        start: dict[str, Any] = {"op": "start", "engine_args": self.engine_args}
        if placement:  # vLLM's Ray executor in the worker's placement group (server.py)
            start["placement"] = placement
        reply = self._call(start)
        self.device = str(reply.get("device") or self.device)
        self.model_info.update(backend="vllm", vllm_version=reply.get("vllm_version"), device=self.device)
        self.block_size = int(reply.get("block_size") or self.block_size)  # vLLM's own (prefix-aware chains)
        self.eos_token_ids = tuple(reply.get("eos_token_ids") or ())
        self.accepts_images = bool(reply.get("multimodal"))  # vLLM runs the model with image inputs
        self.image_token_id = reply.get("image_token_id")  # what vLLM expands an image's placeholder into

    # ---- the process ------------------------------------------------------------------------------------
    def _spawn(self) -> subprocess.Popen:
        env = {**os.environ, **(self.env or {})}
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if self.device == "cpu" else "1")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 - held by Popen
        return subprocess.Popen([self.python, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, env=env)

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(message).encode("utf-8")
        try:
            self._proc.stdin.write(struct.pack(">I", len(data)) + data)
            self._proc.stdin.flush()
            head = self._proc.stdout.read(4)
            if len(head) < 4:
                raise VllmError(self._death())
            (size,) = struct.unpack(">I", head)
            reply = json.loads(self._proc.stdout.read(size).decode("utf-8"))
        except (BrokenPipeError, OSError) as exc:  # a write to a dead process: its exit and log say why
            raise VllmError(self._death(exc)) from None
        if not reply.get("ok") and reply.get("kind") != "request":
            raise VllmError(f"vLLM: {one_line(reply.get('error'))}")
        return reply

    def _death(self, pipe_error: OSError | None = None) -> str:
        """Why the pipe ended: its end of file comes as the process dies, a moment before it can be reaped. The
        log's last lines end the message (the cause); a pipe error is named only when the process still runs
        (a dead one's exit status says more than the broken pipe its death caused)."""
        try:
            code = self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        where = f"; its log: {self.log_path}{log_tail(self.log_path)}" if self.log_path else ""
        if code is not None:
            return f"the vLLM engine process exited (status {code}){where}"
        pipe = f" ({pipe_error})" if pipe_error is not None else ""
        return f"the vLLM engine process stopped answering{pipe}{where}"

    # ---- the contract -------------------------------------------------------------------------------------
    @property
    def num_unfinished_requests(self) -> int:
        return len(self._pending) + len(self._rejected)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | PoolingParams | None = None, *,
                    chat_template_kwargs: dict[str, Any] | None = None, adapter: str | None = None) -> None:
        if request_id in self._pending or any(o.request_id == request_id for o in self._rejected):
            raise ValueError(f"duplicate request id {request_id!r}")
        if isinstance(params, PoolingParams):
            raise ValueError("engine.backend vllm runs generation jobs only (task: generate)")
        params = params or SamplingParams()
        arrival = time.perf_counter()
        images = prompt_images(prompt)
        token_ids, error = self._prompt_ids(prompt, images, chat_template_kwargs, adapter)
        if error is None:
            sampling, structured = vllm_sampling(params)
            message = {"op": "add", "id": request_id, "prompt_token_ids": list(token_ids), "sampling": sampling,
                       "structured": structured}
            if images:  # vLLM expands each placeholder into the image's tokens (vllm_backend/images.py)
                message["images"] = image_payload(images)
            reply = self._call(message)
            if reply.get("ok"):
                self._pending[request_id] = (arrival, len(images), params)
                self._stats.num_requests += 1
                return
            error = f"vLLM refused the request: {one_line(reply.get('error'))}"
        self._rejected += [_error_output(request_id, list(token_ids), error, arrival, i, params.n)
                           for i in range(params.n)]

    def _prompt_ids(self, prompt: Any, images: list, chat_template_kwargs: dict[str, Any] | None,
                    adapter: str | None) -> tuple[list[int], str | None]:
        """(the prompt's token ids, None) as our engine makes them (image parts as the template's placeholders),
        or ([], why the request cannot go to vLLM)."""
        if adapter:
            return [], f"LoRA adapter {adapter!r}: engine.backend vllm runs the base model only"
        if images and not self.accepts_images:
            return [], (f"{len(images)} image(s) in the prompt, but the model "
                        f"({self.model_info.get('architecture', '?')}) takes no images in vLLM")
        try:
            token_ids = list(prompt) if _is_token_ids(prompt) else text_or_chat_token_ids(
                self.tokenizer, template_messages(prompt) if images else prompt, self.chat_template,
                chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a broken chat template or odd input: that request only
            return [], f"could not tokenize the prompt: {exc}"
        return token_ids, None if token_ids else "empty prompt"

    def step(self) -> list[RequestOutput]:
        outputs, self._rejected = self._rejected, []
        if not self._pending:
            return outputs
        reply = self._call({"op": "step"})
        now = time.perf_counter()
        self._stats.steps += 1
        self._stats.decode_s += float(reply.get("step_s") or 0.0)
        self._stats.num_sampled_tokens += int(reply.get("sampled") or 0)
        for record in reply.get("finished") or []:
            arrival, num_images, params = self._pending.pop(record["id"])
            self._stats.num_prompt_tokens += len(record["prompt_token_ids"])  # with images: as vLLM expanded them
            self._stats.num_cached_tokens += int(record.get("num_cached_tokens") or 0)
            finished = _outputs(record, arrival, now, params, self.tokenizer)
            if num_images:
                image_tokens = count_image_tokens(record["prompt_token_ids"], self.image_token_id)
                for out in finished:
                    out.metrics.num_images, out.metrics.num_image_tokens = num_images, image_tokens
                self._stats.num_images += num_images
                self._stats.num_image_tokens += image_tokens
            outputs += finished
            self._stats.num_output_tokens += sum(len(s["token_ids"]) for s in record["samples"])
        return outputs

    def stats(self) -> VllmStats:
        return self._stats

    def rebuild(self) -> VllmEngine:
        """vLLM's weights live in its process: a fresh engine is a new process, so the worker loads anew."""
        raise NotImplementedError("engine.backend vllm: a failed vLLM engine is replaced by a new process")

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._call({"op": "close"})
                self._proc.wait(timeout=CLOSE_TIMEOUT_S)
            except (VllmError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()


LOG_TAIL_LINES = 8  # lines of vLLM's log quoted when its process dies (a traceback's last frames and cause)
LOG_TAIL_CHARS = 1200


def log_tail(path: str, num_lines: int = LOG_TAIL_LINES, max_chars: int = LOG_TAIL_CHARS) -> str:
    """`; it ended with: <last lines> ` of a log (joined by ` | `), or "" when it cannot be read or is empty: why
    vLLM died, in the error the user sees, not only in a file of a worker's node."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16 * max_chars))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()][-num_lines:]
    tail = " | ".join(lines)
    return f"; it ended with: {tail[-max_chars:]}" if tail else ""


ERROR_CHARS = 800  # of vLLM's message in a row's error or a failed start


def one_line(error: Any, max_chars: int = ERROR_CHARS) -> str:
    """vLLM's error message on one line: pydantic's (an engine argument vLLM refuses, e.g. max_model_len over the
    model's) puts the reason on its second line, which a one-line summary would cut off."""
    text = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _is_token_ids(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(t, int) for t in prompt)


def vllm_sampling(params: SamplingParams) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Our sampling settings as vLLM's ``SamplingParams`` keywords, and its structured-output keywords (or
    None). Every field of ours has a vLLM equivalent (docs/driver.md, "vLLM backend")."""
    out: dict[str, Any] = {
        "n": params.n, "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
        "top_k": params.top_k, "min_p": params.min_p, "seed": params.seed, "stop": list(params.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "include_stop_str_in_output": params.include_stop_str_in_output, "ignore_eos": params.ignore_eos,
        "min_tokens": params.min_tokens, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty, "repetition_penalty": params.repetition_penalty,
        "logit_bias": {str(k): v for k, v in params.logit_bias.items()} or None, "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs, "skip_special_tokens": params.skip_special_tokens,
    }
    structured = None
    if params.json_schema is not None:
        structured = {"json": params.json_schema}
    elif params.regex is not None:
        structured = {"regex": params.regex}
    elif params.choice is not None:
        structured = {"choice": list(params.choice)}
    return out, structured


def _outputs(record: dict[str, Any], arrival: float, now: float, params: SamplingParams,
             tokenizer: Any) -> list[RequestOutput]:
    """vLLM's finished request as our RequestOutputs, one per sample (sample_index = vLLM's index)."""
    m = record.get("metrics") or {}
    prompt_ids = list(record["prompt_token_ids"])
    samples = sorted(record["samples"], key=lambda s: s["index"])
    prompt_logprobs = _logprob_entries(record.get("prompt_logprobs"), prompt_ids, tokenizer,
                                       params.prompt_logprobs)
    outputs = []
    for sample in samples:
        tokens = list(sample["token_ids"])
        first, last = _number(m.get("first_token_ts")), _number(m.get("last_token_ts"))
        metrics = RequestMetrics(
            arrival_time=arrival, first_scheduled_time=_number(m.get("scheduled_ts")), first_token_time=first,
            finish_time=now, num_prompt_tokens=len(prompt_ids),
            num_cached_tokens=int(record.get("num_cached_tokens") or 0) if sample["index"] == 0 else 0,
            num_output_tokens=len(tokens), num_preemptions=int(m.get("num_preemptions") or 0),
            prompt_shared=sample["index"] > 0,
            mean_itl_s=(last - first) / (len(tokens) - 1) if first and last and len(tokens) > 1 else None)
        reason = sample.get("finish_reason") or "length"
        outputs.append(RequestOutput(
            request_id=record["id"], prompt_token_ids=prompt_ids, output_token_ids=tokens, text=sample["text"],
            finish_reason=reason if reason in ("stop", "length") else "error",
            error=None if reason in ("stop", "length") else f"vLLM finished the request: {reason}",
            metrics=metrics, logprobs=_logprob_entries(sample.get("logprobs"), tokens, tokenizer, params.logprobs),
            prompt_logprobs=prompt_logprobs if params.prompt_logprobs is not None else None,
            sample_index=sample["index"], num_samples=len(samples)))
    return outputs


def _logprob_entries(positions: list | None, chosen: list[int], tokenizer: Any,
                     k: int | None) -> list[TokenLogprob | None] | None:
    """vLLM's per-position [[token_id, logprob, rank, text], ...] as our TokenLogprob entries: the chosen
    token's log-probability and the ``k`` most likely tokens (rank 1..k), most likely first."""
    if positions is None:
        return None
    entries: list[TokenLogprob | None] = []
    for token_id, position in zip(chosen, positions, strict=False):
        if position is None:
            entries.append(None)
            continue
        by_id = {int(t): (float(lp), rank, text) for t, lp, rank, text in position}
        own = by_id.get(token_id, (float("nan"), None, None))
        top = sorted(((t, v) for t, v in by_id.items() if v[1] is not None and v[1] <= (k or 0)),
                     key=lambda item: item[1][1])
        own_text = _text(own[2], token_id, tokenizer)
        entries.append(TokenLogprob(
            token_id=token_id, token=own_text, logprob=own[0],
            top_logprobs=[TopLogprob(t, _text(v[2], t, tokenizer), v[0], _text(v[2], t, tokenizer).encode())
                          for t, v in top],
            token_bytes=own_text.encode()))
    return entries


def _text(decoded: str | None, token_id: int, tokenizer: Any) -> str:
    if decoded is not None:
        return decoded
    return tokenizer.decode([token_id]) if tokenizer is not None else ""


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _error_output(request_id: str, token_ids: list[int], error: str, arrival: float, index: int,
                  n: int) -> RequestOutput:
    now = time.perf_counter()
    return RequestOutput(request_id=request_id, prompt_token_ids=token_ids, output_token_ids=[], text="",
                         finish_reason="error", error=error,
                         metrics=RequestMetrics(arrival_time=arrival, finish_time=now,
                                                num_prompt_tokens=len(token_ids)),
                         sample_index=index, num_samples=n)
