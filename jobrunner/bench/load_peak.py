"""The peak memory of loading a model, and a random Llama checkpoint of any size to load (issue 44).

``python -m jobrunner.bench.load_peak make DIR --preset 1b`` writes a random Llama (Llama-3.2-1B's shape by
default) as bf16 safetensors shards of ``--shard-mb`` with an index and a config.json, one tensor at a time
(never the whole model in memory). ``python -m jobrunner.bench.load_peak measure DIR [--quantization int4]
[--mode after|before]`` loads it in a fresh process with the CPU's weight packing off
(``JOBRUNNER_PACKED_GEMM=0``, ``JOBRUNNER_ONEDNN_LINEAR=0``: a packed copy is a kernel's choice, not the load's)
and prints one JSON line: the process's own anonymous memory (``RssAnon``, not the page cache of the
memory-mapped shards) at its peak over its value before the load, beside the weights as loaded and the largest
decoder layer in float. ``after`` is the streamed load (models/load_stream.py); ``before`` the load as it was
(materialise in float32 on the device, cast, copy every tensor, then quantize the whole model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

PRESETS = {  # Llama-3.2-1B's shape (1.24 B parameters, tied head); small (~20 M), test (~8 M: tests/bench)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=False),
    "test": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False),  # the head below a layer
}
NO_PACKING = {"JOBRUNNER_PACKED_GEMM": "0", "JOBRUNNER_ONEDNN_LINEAR": "0"}


def make_checkpoint(out: str | Path, preset: str = "1b", shard_mb: int = 512, seed: int = 0) -> Path:
    """Write a random bf16 Llama of ``preset``'s shape to ``out`` as safetensors shards, index and config."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(PRESETS[preset])
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generator = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    num_bytes = total = 0
    for name, shape in _tensor_shapes(config):
        tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if num_bytes + tensor.nbytes > shard_mb << 20 and shard:
            _save_shard(out, shard, weight_map, save_file)
            shard, num_bytes = {}, 0
        shard[name], num_bytes, total = tensor, num_bytes + tensor.nbytes, total + tensor.nbytes
    _save_shard(out, shard, weight_map, save_file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def _config(shape: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", **shape}


def _tensor_shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    shapes = [("model.embed_tokens.weight", (c["vocab_size"], hidden))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                   (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not c["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (c["vocab_size"], hidden)))
    return shapes


def _save_shard(out: Path, shard: dict[str, torch.Tensor], weight_map: dict[str, str], save_file) -> None:
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(shard, str(out / name), metadata={"format": "pt"})
    weight_map.update({k: name for k in shard})


def measure_load(model_dir: str | Path, quantization: str = "none", mode: str = "after",
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Load ``model_dir`` on the CPU in this process and return its memory figures (see the module doc)."""
    from jobrunner.models.load_memory import LoadMemory
    from jobrunner.models.loader import build_model, load_weights
    from jobrunner.models.weights import Checkpoint, load_config

    config = load_config(model_dir)
    device = torch.device("cpu")
    model = build_model(config, dtype, device, 4096, materialize=False)
    layer_float = max(sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers)
    transform = None
    if mode == "after" and quantization != "none":
        from jobrunner.quant.at_load import QuantizeAtLoad

        # before the window: the session's dispatch loads the native kernel libraries, a process's one-time cost
        # (a few MB, the same for any model), not the load's
        transform = QuantizeAtLoad(model, quantization, device)
    with LoadMemory(device, interval_s=0.001) as memory:
        if mode == "after":
            load_weights(model, Checkpoint(model_dir), device=device, transform=transform)
        else:
            model = _load_as_before(config, dtype, device, model_dir, quantization)
    weights = _unique_bytes(model)
    rise = memory.host_rise
    bound = weights + (layer_float if quantization != "none" else 0)
    return {"model_dir": str(model_dir), "mode": mode, "quantization": quantization,
            "dtype": str(dtype).removeprefix("torch."), "num_params_loaded_bytes": weights,
            "layer_float_bytes": layer_float, "host_anon_baseline_bytes": memory.host_baseline,
            "host_anon_rise_bytes": rise, "rise_over_weights": round(rise / weights, 3),
            "rise_over_bound": round(rise / bound, 3), "bound": "weights" + (" + one layer in float"
                                                                        if quantization != "none" else "")}


def _load_as_before(config, dtype, device, model_dir, quantization) -> torch.nn.Module:
    """The load as it was before the streamed loader: float32 on the device, cast, load all, quantize all."""
    from jobrunner.models.loader import build_model, load_weights
    from jobrunner.models.weights import iter_safetensors

    model = build_model(config, torch.float32, torch.device("meta"), 4096, materialize=False)
    model = model.to_empty(device=device).to(dtype=dtype)
    if model.shape.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():
        if hasattr(module, "build_tables"):
            module.build_tables(device)
    load_weights(model, iter_safetensors(model_dir))
    if quantization != "none":
        from jobrunner.quant import quantize_model

        quantize_model(model, quantization)
    return model


def _unique_bytes(model: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def measure_in_subprocess(model_dir: str | Path, quantization: str = "none", mode: str = "after",
                          timeout_s: float | None = None) -> dict[str, Any]:
    """:func:`measure_load` in a fresh Python process (a clean baseline), weight packing off."""
    command = [sys.executable, "-m", "jobrunner.bench.load_peak", "measure", str(model_dir),
               "--quantization", quantization, "--mode", mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={**os.environ, **NO_PACKING})
    if done.returncode != 0:
        raise RuntimeError(f"load_peak measure failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jobrunner.bench.load_peak", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a random Llama checkpoint")
    make.add_argument("out")
    make.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    make.add_argument("--shard-mb", type=int, default=512)
    measure = sub.add_parser("measure", help="load a checkpoint and print its memory figures (JSON)")
    measure.add_argument("model_dir")
    measure.add_argument("--quantization", default="none")
    measure.add_argument("--mode", choices=("after", "before"), default="after")
    args = parser.parse_args(argv)
    if args.command == "make":
        print(make_checkpoint(args.out, args.preset, args.shard_mb))
    else:
        os.environ.update(NO_PACKING)
        print(json.dumps(measure_load(args.model_dir, args.quantization, args.mode)))


if __name__ == "__main__":
    main()
