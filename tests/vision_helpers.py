"""A tiny random SmolVLM (Idefics3: SigLIP encoder, pixel-shuffle connector, Llama decoder) saved as a Hugging Face
directory, and test images made with PIL: for engine parity tests (ours against transformers' ``generate``), the
vLLM backend and the end-to-end image job.

``build_tiny_smolvlm(out_dir)`` writes ``config.json`` + ``model.safetensors`` (float32, seeded) and the processor
(a small trained BPE tokenizer with Idefics3's image tokens, SmolVLM's chat template, ``Idefics3ImageProcessor``
with 32-pixel tiles): what ``jobrunner.models.sources`` accepts as a local model dir. Tiles are 32x32 pixels,
patch 4, pixel shuffle 2 -> 16 image tokens per tile; an image larger than 32 pixels on a side is split into up to
2 x 2 tiles plus the global one.
"""

from __future__ import annotations

from pathlib import Path

TILE = 32           # max_image_size longest edge: one tile's side in pixels
PATCH = 4           # vision patch size
SCALE_FACTOR = 2    # pixel shuffle factor
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR ** 2  # <image> tokens per tile (16)

CORPUS = [
    "Describe the picture in one sentence.",
    "What colour is the square in the image?",
    "A red square on a blue background, next to a green circle.",
    "The cat sat on the mat and looked at the bird outside the window.",
    "Read the text in this document and list the totals.",
    "User: Assistant: image caption photo scene object colour shape",
] * 20

# SmolVLM's chat template (user turns with image and text parts; "Assistant:" as the generation prompt)
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>",
                *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


def make_vlm_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few sentences, with SmolVLM's special and image tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", *IMAGE_TOKENS]
    backend = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<end_of_utterance>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<fake_token_around_image>", "<image>", "<end_of_utterance>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_vlm_processor(tokenizer=None):
    """Idefics3's processor over the tiny tokenizer: 32-pixel tiles, images resized to at most 64 pixels."""
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    tokenizer = tokenizer or make_vlm_tokenizer()
    images = Idefics3ImageProcessor(size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE},
                                    do_image_splitting=True)
    return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                             chat_template=CHAT_TEMPLATE)


def make_tiny_smolvlm(tokenizer, seed: int = 0, **text_overrides):
    """A seeded random ``Idefics3ForConditionalGeneration``: SigLIP 2 layers (hidden 32), Llama 2 layers
    (hidden 64, 4 heads, 2 KV heads), float32."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    eos = tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad,
                tie_word_embeddings=False, **text_overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=TILE, patch_size=PATCH, layer_norm_eps=1e-6)
    config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=SCALE_FACTOR,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), pad_token_id=pad,
                            tie_word_embeddings=False)
    config.architectures = ["Idefics3ForConditionalGeneration"]
    config.eos_token_id = eos
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # larger than the init's 0.02, so that the greedy tokens depend on the image
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                p.normal_(0.0, 0.2 if "vision_model" in name or "connector" in name else 0.12)
    return model


def build_tiny_smolvlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Save a tiny random SmolVLM + its processor to ``out_dir`` (created); returns it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    processor = make_vlm_processor()
    model = make_tiny_smolvlm(processor.tokenizer, seed)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(str(out_dir))
    processor.save_pretrained(str(out_dir))
    return out_dir


def make_test_image(width: int, height: int, seed: int = 0):
    """A deterministic RGB PIL image: colored rectangles on a gradient (different seeds: different images)."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height))
    pixels = [((x * 255) // max(width - 1, 1), (y * 255) // max(height - 1, 1), (seed * 37) % 256)
              for y in range(height) for x in range(width)]
    image.putdata(pixels)
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = min(width, x0 + rng.randrange(4, 24)), min(height, y0 + rng.randrange(4, 24))
        draw.rectangle([x0, y0, x1, y1], fill=(rng.randrange(256), rng.randrange(256), rng.randrange(256)))
    return image


def image_input(image, source: str = "test"):
    """``jobrunner.engine.images.ImageInput`` of a PIL image (PNG bytes, their SHA-256)."""
    import hashlib
    import io

    from jobrunner.engine.images import ImageInput

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    return ImageInput(data=data, digest=hashlib.sha256(data).hexdigest(), mime="image/png", source=source,
                      pixels=image.convert("RGB"))


def image_prompt(text: str, images: list) -> list[dict]:
    """One user message: the images (``ImageInput``) first, then the text (the engine's prompt form)."""
    parts = [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
