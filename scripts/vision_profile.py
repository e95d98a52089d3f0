"""Where a vision-language model's step time goes in our engine, and what repeated images save (issue 49).

Builds a random-weight SmolVLM (Idefics3) checkpoint in a temporary directory -- ``--shape tiny`` (the tests'
model) or ``--shape 256m`` (SmolVLM-256M's sizes: SigLIP 12 x 768, 512-px tiles of patch 16, pixel shuffle 4 =
64 tokens per tile, a 30-layer 576-wide Llama decoder; the tests' small tokenizer, so the LM head is narrow) --
loads it through our loader, and runs ``--rows`` captioning requests whose images repeat ``--repeat`` times each
(the same picture under the same prompt: prefix-cache hits), under :class:`jobrunner.engine.profile.StepProfiler`
(the parts ``jobrunner bench --profile`` prints, ``vision`` among them). Prints one JSON object.

    .venv/bin/python scripts/vision_profile.py --shape 256m --rows 8 --repeat 2 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "tiny": None,  # tests/vision_helpers.py as it is
    "256m": dict(vision=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                             image_size=512, patch_size=16, layer_norm_eps=1e-6),
                 text=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0),
                 scale_factor=4, tile=512),
}


def build(shape: str, out_dir: Path) -> Path:
    """A random checkpoint of ``shape`` with its processor in ``out_dir``."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    from tests import vision_helpers as vh

    if SHAPES[shape] is None:
        return vh.build_tiny_smolvlm(out_dir)
    s = SHAPES[shape]
    tokenizer = vh.make_vlm_tokenizer()
    seq_len = (s["tile"] // s["vision"]["patch_size"]) ** 2 // s["scale_factor"] ** 2
    images = Idefics3ImageProcessor(size={"longest_edge": s["tile"]}, max_image_size={"longest_edge": s["tile"]})
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=seq_len,
                                  chat_template=vh.CHAT_TEMPLATE)
    eos = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    text = dict(model_type="llama", vocab_size=len(tokenizer), rms_norm_eps=1e-5, eos_token_id=eos,
                pad_token_id=0, tie_word_embeddings=True, **s["text"])
    config = Idefics3Config(text_config=text, vision_config=s["vision"], scale_factor=s["scale_factor"],
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=0)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).eval().save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return out_dir


def run(model_dir: Path, rows: int, repeat: int, max_tokens: int, image_px: int, batch_tokens: int) -> dict:
    from jobrunner.engine import EngineConfig, LLMEngine, SamplingParams
    from jobrunner.engine.profile import StepProfiler
    from tests.vision_helpers import image_input, image_prompt, make_test_image

    engine = LLMEngine.from_source(str(model_dir), dtype="float32",
                                   config=EngineConfig(device="cpu", max_num_batched_tokens=batch_tokens))
    pictures = [image_input(make_test_image(image_px, image_px, seed=i)) for i in range(-(-rows // repeat))]
    prompts = [image_prompt("Describe the picture.", [pictures[i // repeat]]) for i in range(rows)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    with StepProfiler(engine) as profiler:
        outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    stats = engine.stats()
    summary = profiler.summary(seconds)
    return {"rows": rows, "distinct_images": len(pictures), "image_tokens_per_row": outs[0].metrics.num_image_tokens,
            "prompt_tokens_per_row": outs[0].metrics.num_prompt_tokens, "max_tokens": max_tokens,
            "run_s": round(seconds, 3), "steps_s": summary["seconds"],
            "parts_share": {k: round(v["share"], 4) for k, v in summary["parts"].items()},
            "vision_encoder_s": round(stats.vision_encoder_s, 3), "num_images_encoded": stats.num_images_encoded,
            "num_prompt_tokens": stats.num_prompt_tokens, "num_cached_tokens": stats.num_cached_tokens,
            "cached_per_row": [o.metrics.num_cached_tokens for o in outs],
            "num_image_tokens": stats.num_image_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=2, help="rows per distinct image (1: all different)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-px", type=int, default=48, help="side of the square test pictures")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(args.shape, Path(tmp))
        result = run(model_dir, args.rows, args.repeat, args.max_tokens, args.image_px, args.max_num_batched_tokens)
    print(json.dumps({"shape": args.shape, "threads": args.threads or "default", **result}, indent=1))


if __name__ == "__main__":
    main()
