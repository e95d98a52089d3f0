"""The tiny random SmolVLM (tests/vision_helpers.py) in a shape vLLM's CPU build runs: its CPU attention takes
head sizes of 32 and up (32, 64, 80, ...), the tiny model's Llama has 16 (hidden 64 / 4 heads). The same model
with ``head_dim`` 32 runs on vLLM, on our engine and in transformers alike."""

from __future__ import annotations

from pathlib import Path

VLLM_HEAD_DIM = 32  # the smallest head size vLLM's CPU attention takes


def build_vllm_smolvlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Save the tiny SmolVLM with head_dim 32 and its processor to ``out_dir`` (created); returns it."""
    from tests.vision_helpers import make_tiny_smolvlm, make_vlm_processor

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor = make_vlm_processor()
    model = make_tiny_smolvlm(processor.tokenizer, seed, head_dim=VLLM_HEAD_DIM)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return out_dir


def hf_generate(model_dir: str | Path, prompts: list, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """transformers' own greedy ``generate`` with the model's processor, one prompt at a time (engine-form chat
    prompts, tests/vision_helpers.image_prompt): [(prompt token ids, output token ids)] in order."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    from jobrunner.engine.images import prompt_images
    from jobrunner.vllm_backend.images import template_messages

    processor = AutoProcessor.from_pretrained(str(model_dir))
    model = Idefics3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        text = processor.apply_chat_template(template_messages(prompt), add_generation_prompt=True)
        images = [image.pixels for image in prompt_images(prompt)]
        inputs = processor(text=text, images=[images] if images else None, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        n = inputs["input_ids"].shape[1]
        tokens = ids[0, n:].tolist()
        eos = model.generation_config.eos_token_id
        out.append((inputs["input_ids"][0].tolist(), tokens[:tokens.index(eos) + 1] if eos in tokens else tokens))
    return out
