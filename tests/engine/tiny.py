"""Tiny random-weight models and a small trained tokenizer, built in seconds for engine tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from jobrunner.engine import EngineConfig
from jobrunner.engine.llm_engine import LLMEngine
from jobrunner.models.loader import build_model, load_weights

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Write a persuasive email to convince your introverted friend to volunteer as a guest speaker.",
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
    "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
] * 20

ARCH_KWARGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
    "llama_tied": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True,
                  head_dim=16),
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False,
                 pad_token_id=0),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>",
                                                                        "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_hf_model(arch: str = "llama", vocab_size: int = 384, seed: int = 0, **overrides):
    kwargs = dict(ARCH_KWARGS[arch])
    model_type = kwargs.pop("model_type")
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, **kwargs)
    cfg.update(overrides)
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # larger weights than the default init: sharper logits, fewer near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


def engine_from_hf(hf_model, tokenizer, **config) -> LLMEngine:
    model = build_model(hf_model.config, torch.float32, torch.device("cpu"))
    load_weights(model, hf_model.state_dict().items())
    config.setdefault("num_kv_blocks", 4096 // config.get("block_size", 16))  # a small pool: fast integrity checks
    return LLMEngine(model, tokenizer, EngineConfig(**config), eos_token_ids=[tokenizer.eos_token_id])
