"""Write a draft model for speculative decoding: a model's first N decoder layers (plus its embeddings, final norm
and head), as a local model directory (safetensors + config + tokenizer) that `engine.speculative` can load.

No training: the truncated model predicts with the target's own head from an earlier layer's hidden state, so
its drafts agree with the target only where the next token is easy (copies, punctuation, common continuations).
It is what can be built honestly offline here, where no second model of the SmolLM2 tokenizer exists; a real
draft is a smaller model trained on the same tokenizer (Llama-3.2-1B for Llama-3-8B).

Usage: python scripts/make_truncated_draft.py [--source smollm2-135m-instruct] --layers 6 --out /tmp/smollm2-l6
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from jobrunner.models.sources import resolve_model_dir

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def truncate(source: str, num_layers: int, out: Path) -> Path:
    """Copy ``source``'s directory to ``out`` keeping decoder layers ``0 .. num_layers - 1``."""
    src = resolve_model_dir(source)
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in 1..{config['num_hidden_layers'] - 1}")
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy2(path, out / path.name)
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(path)).items():
            match = LAYER.match(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = tensor.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    config["_truncated_from"] = f"{source} (first {num_layers} layers, scripts/make_truncated_draft.py)"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="smollm2-135m-instruct")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(truncate(args.source, args.layers, Path(args.out)))


if __name__ == "__main__":
    main()
