"""`jobrunner bench --lora-steps`: the step time of a batch whose rows use several LoRA adapters, against one
adapter and none, on one engine (jobrunner.models.lora).

Random PEFT-format adapters (rank ``rank`` on every projection of every layer: q, k, v, o, gate, up, down) are
written for the model and attached once; then for each case the same number of rows with distinct random
prompts is admitted, prefilled in one step, and decoded: the prefill step and the decode steps are timed. The
cases take turns over ``rounds`` rounds (a machine's drift hits each alike); each figure is the median.
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
                    num_adapters: int = 4, rank: int = 16, prompt_len: int = 64, decode_steps: int = 16,
                    rounds: int = 3) -> dict[str, Any]:
    """Prefill and median decode step times (ms) of ``num_rows`` rows for each case (see the module doc)."""
    from jobrunner.engine import EngineConfig, LLMEngine
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
    cases = {"base": [None] * num_rows, "one adapter": ["a0"] * num_rows,
             "mixed": [f"a{i % num_adapters}" for i in range(num_rows)]}
    _run_case(engine, cases["mixed"], prompt_len, 2, seed=99)  # warm-up (allocations, native builds)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in cases}
    for round_index in range(rounds):
        for i, (name, adapters) in enumerate(cases.items()):
            prefill, decode = _run_case(engine, adapters, prompt_len, decode_steps, seed=10 * round_index + i)
            times[name][0].append(prefill)
            times[name][1].extend(decode)
    results = {name: {"prefill_ms": round(statistics.median(p) * 1e3, 2),
                      "decode_step_ms": round(statistics.median(d) * 1e3, 2), "decode_steps": len(d)}
               for name, (p, d) in times.items()}
    return {"model": source, "dtype": str(model.dtype).removeprefix("torch."), "device": str(engine.device),
            "rows": num_rows, "adapters": num_adapters, "rank": rank, "prompt_len": prompt_len,
            "adapter_bytes": engine.model_info.get("adapter_bytes"), "cases": results}


def _run_case(engine, adapters: list[str | None], prompt_len: int, decode_steps: int, seed: int
              ) -> tuple[float, list[float]]:
    """Seconds of the prefill step and of each decode step (the last, which also frees every row, left out)."""
    from jobrunner.engine import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.shape.vocab_size
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
    for i, adapter in enumerate(adapters):
        prompt = torch.randint(10, vocab - 1, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"{seed}-{i}", prompt, params, adapter=adapter)
    times = []
    while engine.has_unfinished_requests():
        sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
        start = time.perf_counter()
        engine.step()
        sync()
        times.append(time.perf_counter() - start)
    return times[0], times[1:-1] or times[1:]


def render_lora_steps(result: dict[str, Any]) -> list[str]:
    """The table of :func:`lora_step_times`, one line per case, with the ratio to ``base``."""
    cases = result["cases"]
    base = cases["base"]
    lines = [f"LoRA step times: {result['model']} ({result['dtype']}, {result['device']}), {result['rows']} rows, "
             f"{result['adapters']} adapters of rank {result['rank']} on every projection, prompts of "
             f"{result['prompt_len']} tokens; adapters {result['adapter_bytes'] / 1e6:.1f} MB",
             f"{'case':<14}{'prefill ms':>12}{'decode step ms':>16}{'vs base':>10}"]
    for name, c in cases.items():
        lines.append(f"{name:<14}{c['prefill_ms']:>12.1f}{c['decode_step_ms']:>16.2f}"
                     f"{c['decode_step_ms'] / base['decode_step_ms']:>9.2f}x")
    return lines
