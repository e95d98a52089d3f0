"""`jobrunner bench --lora-steps`: the step time of a batch whose rows use several LoRA adapters, against one
adapter and none, on one engine (jobrunner.models.lora).

Random PEFT-format adapters (rank ``rank`` on every projection of every layer: q, k, v, o, gate, up, down) are
written for the model and attached once; ``num_rows`` rows with distinct random prompts are admitted, and their
prefill step (every prompt whole) and then their first decode step are each run ``repeats`` times per case, the
cases taking turns call by call (a busy machine's drift hits each alike), with the rows' adapters set per case;
each figure is the median.
Cases: ``base`` (rows without an adapter: the wrappers' cost when no row uses them), ``one adapter`` (every
row on adapter 0), ``mixed`` (rows round-robin over ``num_adapters`` adapters, so every adapter's rows are
scattered through the batch: the gathered path).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from jobrunner.models.lora_files import CONFIG_FILE, TARGETS, WEIGHTS_FILE

MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def write_random_adapter(out_dir: Path, model: torch.nn.Module, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter directory for ``model`` with random A and B on every projection of every layer."""
    from jobrunner.models.lora import layer_dims

    dims, gen = layer_dims(model), torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.shape.num_layers):
        for module in MODULES:
            ours, part = TARGETS[module]
            in_features, out_features = dims.in_out(ours)
            start, end = (0, out_features) if part == "all" else dims.columns(part)
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * in_features ** -0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(end - start, rank, generator=gen) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "task_type": "CAUSAL_LM",
              "target_modules": [m.rpartition(".")[2] for m in MODULES]}
    (out_dir / CONFIG_FILE).write_text(json.dumps(config))


def lora_step_times(source: str, *, dtype: str = "auto", device: str = "auto", num_rows: int = 16,
                    num_adapters: int = 4, rank: int = 16, prompt_len: int = 64, repeats: int = 15,
                    ) -> dict[str, Any]:
    """Median times (ms) of one prefill step and one decode step of ``num_rows`` rows in each case (module doc)."""
    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
    from jobrunner.engine.adapters import load_adapters_onto
    from jobrunner.models.factory import load_for_engine

    model, tokenizer, eos, info = load_for_engine(source, dtype=dtype, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        names = {f"a{i}": str(Path(tmp) / f"a{i}") for i in range(num_adapters)}
        for i, path in enumerate(names.values()):
            write_random_adapter(Path(path), model, rank, seed=i)
        load_adapters_onto(model, names)
    config = EngineConfig(max_num_seqs=num_rows, max_num_batched_tokens=num_rows * prompt_len, speculative="off",
                          enable_prefix_caching=False, device=str(next(model.parameters()).device))
    engine = LLMEngine(model, tokenizer, config, eos, info)
    cases = {"base": [0] * num_rows, "one adapter": [1] * num_rows,
             "mixed": [1 + i % num_adapters for i in range(num_rows)]}
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(num_rows):
        prompt = torch.randint(10, model.shape.vocab_size - 1, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, params)
    prefill = engine.scheduler.schedule()  # every row's whole prompt in one step
    prefill_ms = _alternating(engine, prefill, cases, repeats)
    result = engine.runner.execute(prefill)
    prefill.advance()
    engine.scheduler.update_from_output(prefill, result, time.perf_counter())
    decode_ms = _alternating(engine, engine.scheduler.schedule(), cases, repeats)
    results = {name: {"prefill_ms": prefill_ms[name], "decode_step_ms": decode_ms[name]} for name in cases}
    return {"model": source, "dtype": str(model.dtype).removeprefix("torch."), "device": str(engine.device),
            "rows": num_rows, "adapters": num_adapters, "rank": rank, "prompt_len": prompt_len,
            "repeats": repeats, "adapter_bytes": engine.model_info.get("adapter_bytes"), "cases": results}


def _alternating(engine, sched, cases: dict[str, list[int]], repeats: int) -> dict[str, float]:
    """Median ms of running the scheduled step ``sched`` with each case's adapter per row, the cases taking
    turns call by call (so a busy machine's drift hits each alike). The step's outputs are dropped: it is run
    again and again on the same KV slots."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    rows = [s.request for s in sched.scheduled]
    times: dict[str, list[float]] = {name: [] for name in cases}
    for repeat in range(repeats + 1):  # the first round warms up (allocations, native builds)
        for name, adapter_ids in cases.items():
            for request, adapter_id in zip(rows, adapter_ids):
                request.adapter_id = adapter_id
            start = time.perf_counter()
            engine.runner.execute(sched)
            sync()
            if repeat:
                times[name].append(time.perf_counter() - start)
    for request in rows:
        request.adapter_id = 0
    return {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}


def render_lora_steps(result: dict[str, Any]) -> list[str]:
    """The table of :func:`lora_step_times`, one line per case, with the ratio to ``base``."""
    cases = result["cases"]
    base = cases["base"]
    lines = [f"LoRA step times: {result['model']} ({result['dtype']}, {result['device']}), {result['rows']} rows, "
             f"{result['adapters']} adapters of rank {result['rank']} on every projection, prompts of "
             f"{result['prompt_len']} tokens, median of {result['repeats']} runs of each step; adapters "
             f"{result['adapter_bytes'] / 1e6:.1f} MB",
             f"{'case':<14}{'prefill step ms':>16}{'vs base':>9}{'decode step ms':>16}{'vs base':>9}"]
    for name, c in cases.items():
        lines.append(f"{name:<14}{c['prefill_ms']:>16.1f}{c['prefill_ms'] / base['prefill_ms']:>8.2f}x"
                     f"{c['decode_step_ms']:>16.2f}{c['decode_step_ms'] / base['decode_step_ms']:>8.2f}x")
    return lines
