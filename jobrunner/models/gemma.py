"""Our Gemma 2 and Gemma 3 (text-only, ``gemma3_text``: Gemma 3 270M / 1B) decoders over the paged KV cache.

The same engine contract as :mod:`jobrunner.models.llama` (flat ``[T]`` token batches, fused q|k|v and gate|up
``nn.Linear`` projections that quantization can swap, ``forward`` -> hidden, ``compute_logits``), with what
Gemma does differently, reproduced from transformers 5's ``modeling_gemma2`` / ``modeling_gemma3``:

* RMSNorm scales by ``1 + weight`` (the checkpoint stores the offset from 1) and runs in float32, cast back
  to the activation dtype at the end (not Llama's cast-then-multiply);
* the embedding is multiplied by ``sqrt(hidden_size)`` as a float32 scalar cast to the model dtype first;
* four norms per layer: input, post-attention (on the attention output, before the residual add),
  pre- and post-feed-forward; the MLP is ``act(gate) * up`` with ``hidden_activation`` (GELU-tanh);
* attention scale ``query_pre_attn_scalar ** -0.5``; Gemma 3 adds per-head q/k norms (the same 1 + w norm);
* local (sliding-window) and global layers alternate (``layer_types``): each layer takes its window's view of
  the step metadata (``AttentionMetadata.for_layer``); Gemma 3's local layers have their own rope base
  (``rope_parameters["sliding_attention"]``) and only global layers carry rope scaling (linear x8 on 1B+);
* soft-capping: Gemma 2 caps attention logits (``attn_logit_softcapping``, passed to the backend) and the final
  logits (``final_logit_softcapping``); Gemma 3 caps final logits only when its config says so. transformers'
  Gemma 3 attention never applies ``attn_logit_softcapping`` (it does not pass it on), so neither do we.

Bidirectional attention (``use_bidirectional_attention``, the embedding variants) is refused.

Tensor parallel as in :mod:`jobrunner.models.llama` (:mod:`jobrunner.models.parallel`): the norms, the embedding
scale and the soft-capping are per token or per element, so they run on the reduced / gathered values alike.
"""

from __future__ import annotations

import torch
from torch import nn

from jobrunner.attention import AttentionMetadata
from jobrunner.models.llama import Attention, ModelShape, make_embedding
from jobrunner.models.parallel import TensorParallel
from jobrunner.models.parallel.layers import gather_logits, parallel_embed, split_shape, vocab_rows
from jobrunner.models.rope import RotaryEmbedding

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_shape(config) -> ModelShape:
    """The engine's :class:`ModelShape` of a Gemma 2 / Gemma 3 text config (per-layer windows, soft-capping)."""
    arch = config.architectures[0]
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: use_bidirectional_attention=true is not supported (causal decoding only)")
    layer_types = tuple(config.layer_types)
    if len(layer_types) != config.num_hidden_layers or set(layer_types) - set(LAYER_TYPES):
        raise ValueError(f"{arch}: layer_types must name {', '.join(LAYER_TYPES)} for each of the "
                         f"{config.num_hidden_layers} layers, got {list(layer_types)}")
    window = config.sliding_window
    if window is not None and int(window) < 1:
        raise ValueError(f"{arch}: sliding_window must be a positive number of tokens, got {window!r}")
    windows = tuple(int(window) if t == "sliding_attention" and window is not None else None for t in layer_types)
    softcap = config.attn_logit_softcapping if arch == "Gemma2ForCausalLM" else None
    return ModelShape(
        architecture=arch,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        attention_bias=bool(config.attention_bias),
        qk_norm=arch == "Gemma3ForCausalLM",
        layer_windows=windows,
        attn_logit_softcapping=None if softcap is None else float(softcap),
    )


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)`` in float32, cast back to x's dtype (transformers' Gemma RMSNorm)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(Attention):
    """Llama's attention (projection, q/k norms, rope: :meth:`Attention.rotated_qkv`) with Gemma's norms, scale,
    o_proj bias, per-layer window and soft-capping."""

    def __init__(self, shape: ModelShape, config, layer_index: int) -> None:
        nn.Module.__init__(self)
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.attention_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=shape.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.softcap = shape.attn_logit_softcapping

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; rope: this layer type's (cos, sin) of the step's positions
        q, k, v = self.rotated_qkv(x, rope)
        layer_meta = meta.for_layer(self.layer_index)  # this layer's window (local or global)
        if self.softcap is None:
            out = self.attend(q, k, v, k_cache, v_cache, layer_meta, self.scale)
        else:
            out = self.attend(q, k, v, k_cache, v_cache, layer_meta, self.scale, softcap=self.softcap)
        out = self.o_proj(out)
        return out if self.tp is None else self.tp.all_reduce(out)


class GemmaMLP(nn.Module):
    tp: TensorParallel | None = None  # set on a split model: down_proj's partial sums are all-reduced

    def __init__(self, shape: ModelShape, config) -> None:
        super().__init__()
        from transformers.activations import ACT2FN  # the very activation transformers runs ("gelu_pytorch_tanh")

        self.intermediate_size = shape.intermediate_size
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(self.act_fn(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, config, layer_index: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        size, eps = shape.hidden_size, shape.rms_norm_eps
        self.layer_type = config.layer_types[layer_index]
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = GemmaAttention(shape, config, layer_index)
        self.self_attn.tp = tp
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GemmaMLP(shape, config)
        self.mlp.tp = tp
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, rope, meta, k_cache, v_cache):
        h = self.self_attn(self.input_layernorm(x), rope, meta, k_cache, v_cache)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class LayerTypeRotary(RotaryEmbedding):
    """The rope tables of one Gemma 3 layer type (its own ``rope_parameters[layer_type]`` entry)."""

    def __init__(self, config, layer_type: str, head_dim: int, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.inv_freq, self.scaling = layer_type_inv_freq(config, layer_type, head_dim)
        self.max_positions = max_positions
        self.long_threshold, self.long_inv_freq = None, None  # longrope's long table: not a Gemma scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables(torch.device("cpu"))


LAYER_TYPE_ROPE_TYPES = ("default", "linear")


def layer_type_inv_freq(config, layer_type: str, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and cos/sin scaling of one layer type, as Gemma3RotaryEmbedding computes them."""
    params = config.rope_parameters[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type not in LAYER_TYPE_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling rope_type={rope_type!r} on Gemma 3 {layer_type} layers; "
                         f"supported: {', '.join(LAYER_TYPE_ROPE_TYPES)}")
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):  # also when the model itself is being built on "meta"
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
    return inv_freq.float(), float(scaling)


class GemmaForCausalLM(nn.Module):
    """Gemma 2 / Gemma 3 text: the decoder stack plus the (tied) LM head, with final logit soft-capping."""

    lora = None  # the attached LoRA adapters (models/lora.py: AdapterSet), if any

    def __init__(self, config, max_positions: int | None = None,
                 tensor_parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.shape, self.shard_plan = split_shape(gemma_shape(config), tensor_parallel)
        self.tensor_parallel = tensor_parallel if self.shard_plan is not None else None
        s, tp = self.shape, self.tensor_parallel
        positions = max_positions or s.max_position_embeddings
        self.layer_types = tuple(config.layer_types)
        if s.architecture == "Gemma3ForCausalLM":  # one rope table per layer type (own base, own scaling)
            self.rotaries = nn.ModuleDict({t: LayerTypeRotary(config, t, s.head_dim, positions)
                                           for t in sorted(set(self.layer_types))})
        else:  # Gemma 2: one rope for every layer
            shared = RotaryEmbedding(config, s.head_dim, positions)
            self.rotaries = nn.ModuleDict({t: shared for t in sorted(set(self.layer_types))})
        self.rotary = next(iter(self.rotaries.values()))  # the engine reads rotary.max_positions (same for all)
        self.embed_tokens = make_embedding(vocab_rows(s, self.shard_plan), s.hidden_size)
        self.register_buffer("embed_scale", torch.empty(0), persistent=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(s, config, i, tp) for i in range(s.num_layers))
        self.norm = GemmaRMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, vocab_rows(s, self.shard_plan), bias=False)
        if s.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.build_tables(torch.device("cpu"))

    def build_tables(self, device: torch.device) -> None:
        """The embedding normalizer: ``sqrt(hidden_size)`` as a float32 scalar (cast to the activations' dtype
        in forward, as transformers does); the loader calls this again after building on "meta"."""
        self.embed_scale = torch.tensor(self.shape.hidden_size ** 0.5, dtype=torch.float32, device=device)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the norms' weights keep it whatever quantization did to the other layers)."""
        return self.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        # kv_cache: [num_layers, 2, num_slots, num_kv_heads, head_dim]
        tp = self.tensor_parallel
        x = self.embed_tokens(input_ids) if tp is None else parallel_embed(self.embed_tokens, input_ids, tp,
                                                                           self.shard_plan)
        x = x * self.embed_scale.to(x.dtype)
        ropes = {t: rotary(positions, x.dtype) for t, rotary in self.rotaries.items()}  # once per step per type
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes[self.layer_types[i]], meta, kv_cache[i, 0], kv_cache[i, 1])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.tensor_parallel is not None:
            logits = gather_logits(logits, self.tensor_parallel, self.shape.vocab_size)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
