"""vLLM's engine behind a pipe: run by jobrunner's `VllmEngine` as `PYTHON server.py` in the Python that has vLLM
(its own venv: vLLM pins torch and transformers versions of its own). Imports vLLM and the standard library
only, never jobrunner, so that Python needs nothing of ours.

Protocol: on the original stdout, length-prefixed JSON replies (4-byte big-endian length, then UTF-8 JSON); on
stdin, requests in the same framing. vLLM's own log lines go to stderr (stdout is redirected there before vLLM
is imported). One request, one reply, in order:

- ``{"op": "start", "engine_args": {...}, "placement": {...} | absent}`` -> ``{"ok": true, "vllm_version": ...,
  "eos_token_ids": [...], "multimodal": whether the model takes images, "image_token_id": ...}`` (``placement``:
  ``{"placement_group_id": hex, "address": GCS address}``: the worker's Ray placement group, which vLLM's Ray
  executor fills with its ranks: pipeline stages across nodes)
- ``{"op": "add", "id": ..., "prompt_token_ids": [...], "sampling": {...}, "structured": {...} | null,
  "images": [{"digest", "width", "height", "rgb": base64 of RGB bytes}] | absent}``
  -> ``{"ok": true}`` or ``{"ok": false, "error": ...}`` (a ValueError / TypeError of vLLM's, or any failure to
  process a request's images: nothing queued). Images go to vLLM as its multi-modal data (PIL images), their
  digests as its multi-modal UUIDs; the ids hold the chat template's image placeholders, which vLLM expands.
- ``{"op": "step"}`` -> ``{"ok": true, "finished": [output...], "unfinished": N, "step_s": s, "sampled": k}``
  (``sampled``: output tokens produced in this step, finished requests or not)
- ``{"op": "stats"}`` -> ``{"ok": true, "stats": {...}}``
- ``{"op": "names"}`` -> ``{"ok": true, "engine_args": [...]}`` (vLLM's engine argument names)
- ``{"op": "close"}`` -> ``{"ok": true}``, then the process exits.

A finished output: ``{"id", "prompt_token_ids", "samples": [{"index", "text", "token_ids", "finish_reason",
"logprobs"}], "prompt_logprobs", "metrics": {"arrival_time", "queued_ts", "scheduled_ts", "first_token_ts",
"last_token_ts", "num_preemptions", "num_generation_tokens"}, "num_cached_tokens"}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
import threading
import time
import traceback


def _read(stream) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (size,) = struct.unpack(">I", head)
    return json.loads(stream.read(size).decode("utf-8"))


def _write(stream, message: dict) -> None:
    data = json.dumps(message).encode("utf-8")
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def _logprobs(entries) -> list | None:
    """vLLM's per-position {token_id: Logprob} -> [[token_id, logprob, rank, decoded_token], ...] per position."""
    if entries is None:
        return None
    out = []
    for position in entries:
        if position is None:
            out.append(None)
            continue
        out.append([[int(t), float(lp.logprob), lp.rank, lp.decoded_token] for t, lp in position.items()])
    return out


def _metrics(stats) -> dict:
    if stats is None:
        return {}
    names = ("arrival_time", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts", "num_preemptions",
             "num_generation_tokens")
    return {n: getattr(stats, n, None) for n in names}


def _finished(output, completions: dict) -> dict:
    """A finished request with every sample: with n > 1 vLLM hands back, each step, only the samples that
    changed in it, so ``completions`` (index -> latest CompletionOutput) holds the ones seen earlier."""
    return {
        "id": output.request_id,
        "prompt_token_ids": list(output.prompt_token_ids or []),
        "samples": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                     "finish_reason": c.finish_reason, "logprobs": _logprobs(c.logprobs)}
                    for _, c in sorted(completions.items())],
        "prompt_logprobs": _logprobs(output.prompt_logprobs),
        "metrics": _metrics(getattr(output, "metrics", None)),
        "num_cached_tokens": getattr(output, "num_cached_tokens", None) or 0,
    }


class Server:
    """One vLLM engine and the counters jobrunner's stats need."""

    def __init__(self) -> None:
        self.engine = None
        self.unfinished: set[str] = set()
        self.samples: dict[str, dict] = {}  # request id -> {sample index: its latest CompletionOutput}
        self.stats = {"steps": 0, "step_s": 0.0, "num_prompt_tokens": 0, "num_cached_tokens": 0,
                      "num_output_tokens": 0, "num_requests": 0, "num_sampled_tokens": 0}

    def start(self, engine_args: dict, placement: dict | None = None) -> dict:
        import vllm
        from vllm import EngineArgs, LLMEngine

        if placement:
            self.engine = _engine_in_placement_group(EngineArgs(**engine_args), placement)
        else:
            self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_args))
        tokenizer = self.engine.get_tokenizer() if hasattr(self.engine, "get_tokenizer") else None
        eos = getattr(tokenizer, "eos_token_id", None)
        config = getattr(self.engine, "vllm_config", None)
        block_size = getattr(getattr(config, "cache_config", None), "block_size", None)
        model_config = getattr(config, "model_config", None)
        return {"vllm_version": vllm.__version__, "eos_token_ids": [eos] if eos is not None else [],
                "block_size": block_size, "device": _device_type(),
                "multimodal": bool(getattr(model_config, "is_multimodal_model", False)),
                "image_token_id": _image_token_id(getattr(model_config, "hf_config", None))}

    def add(self, message: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = dict(message["sampling"])
        structured = message.get("structured")
        if structured:
            from vllm.sampling_params import StructuredOutputsParams

            sampling["structured_outputs"] = StructuredOutputsParams(**structured)
        params = SamplingParams(**sampling)
        prompt = TokensPrompt(prompt_token_ids=message["prompt_token_ids"])
        if message.get("images"):
            prompt["multi_modal_data"] = {"image": [_pil_image(i) for i in message["images"]]}
            prompt["multi_modal_uuids"] = {"image": [i["digest"] for i in message["images"]]}
        self.engine.add_request(message["id"], prompt, params, arrival_time=time.time())
        self.unfinished.add(message["id"])
        self.stats["num_requests"] += 1
        return {}

    def step(self) -> dict:
        start = time.perf_counter()
        outputs = self.engine.step() if self.unfinished else []
        spent = time.perf_counter() - start
        self.stats["steps"] += 1
        self.stats["step_s"] += spent
        finished, sampled = [], 0
        for output in outputs:
            completions = self.samples.setdefault(output.request_id, {})
            for c in output.outputs:
                sampled += len(c.token_ids) - (len(completions[c.index].token_ids) if c.index in completions else 0)
                completions[c.index] = c
            if not output.finished:
                continue
            self.samples.pop(output.request_id, None)
            self.unfinished.discard(output.request_id)
            record = _finished(output, completions)
            self.stats["num_prompt_tokens"] += len(record["prompt_token_ids"])
            self.stats["num_cached_tokens"] += record["num_cached_tokens"]
            self.stats["num_output_tokens"] += sum(len(s["token_ids"]) for s in record["samples"])
            finished.append(record)
        self.stats["num_sampled_tokens"] += sampled
        return {"finished": finished, "unfinished": len(self.unfinished), "step_s": spent, "sampled": sampled}

    def names(self) -> dict:
        from vllm import EngineArgs

        return {"engine_args": sorted(f.name for f in dataclasses.fields(EngineArgs))}


def _engine_in_placement_group(args, placement: dict):
    """vLLM's engine with its Ray executor placed in an existing placement group (the jobrunner worker's, by
    id): this process joins the cluster at ``placement["address"]`` (its Ray must be the cluster's version),
    and vLLM takes ``parallel_config.placement_group`` as it is instead of making its own."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    from vllm import LLMEngine, envs
    from vllm.v1.executor.abstract import Executor

    if not ray.is_initialized():
        ray.init(address=placement["address"], logging_level="WARNING")
    config = args.create_engine_config()
    config.parallel_config.placement_group = PlacementGroup(
        PlacementGroupID(bytes.fromhex(placement["placement_group_id"])))
    return LLMEngine(vllm_config=config, executor_class=Executor.get_class(config),
                     log_stats=not args.disable_log_stats, multiprocess_mode=bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING))


def _device_type() -> str | None:
    """The device vLLM's build runs on ("cuda", "cpu", ...), as its platform layer says (None if it cannot)."""
    try:
        from vllm.platforms import current_platform

        return str(current_platform.device_type)
    except Exception:  # noqa: BLE001 - a version without it: the caller keeps its own guess
        return None


def _image_token_id(hf_config) -> int | None:
    """The id of the token an image's features take (``image_token_id`` / ``image_token_index`` of the model's
    config), or None for a text-only model."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


def _pil_image(payload: dict):
    """One image of an ``add`` message as the RGB PIL image vLLM's processor takes."""
    import base64

    from PIL import Image

    size = (int(payload["width"]), int(payload["height"]))
    return Image.frombytes("RGB", size, base64.b64decode(payload["rgb"]))


def _is_request_error(exc: Exception, message: dict | None = None) -> bool:
    """A request vLLM refuses (bad settings, too long; with images, any failure of its multi-modal processing,
    which runs before the request reaches the engine core): the caller makes it that row's error."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "EngineDeadError" in names:
        return False
    if message is not None and message.get("images"):
        return True
    return isinstance(exc, (ValueError, TypeError)) or "VLLMClientError" in names


PARENT_CHECK_S = 1.0


def watch_parent(parent: int, interval_s: float = PARENT_CHECK_S) -> threading.Thread:
    """End this process once ``parent`` (the worker) is gone: its pipe closing ends the read loop, but a step
    that hangs inside vLLM never reads again, and an orphaned engine would hold its cores and memory forever."""

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                os._exit(0)

    thread = threading.Thread(target=watch, name="jobrunner-parent-watch", daemon=True)
    thread.start()
    return thread


def main() -> int:
    watch_parent(os.getppid())
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")  # the protocol's channel
    os.dup2(2, 1)  # everything else printed to stdout (vLLM's logs) goes to stderr
    sys.stdout = sys.stderr
    server = Server()
    while True:
        message = _read(requests)
        if message is None or message.get("op") == "close":
            if message is not None:
                _write(replies, {"ok": True})
            return 0
        op = message.get("op")
        try:
            if op == "start":
                reply = server.start(message["engine_args"], message.get("placement"))
            elif op == "add":
                reply = server.add(message)
            elif op == "step":
                reply = server.step()
            elif op == "stats":
                reply = {"stats": dict(server.stats)}
            elif op == "names":
                reply = server.names()
            else:
                raise ValueError(f"unknown op {op!r}")
            _write(replies, {"ok": True, **reply})
        except Exception as exc:  # noqa: BLE001 - reported: a refused request, or the engine itself failed
            refused = op == "add" and _is_request_error(exc, message)
            if not refused:
                traceback.print_exc(file=sys.stderr)
            _write(replies, {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                             "kind": "request" if refused else "engine"})


if __name__ == "__main__":
    sys.exit(main())
