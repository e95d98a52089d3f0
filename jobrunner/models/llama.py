"""Our Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2, Phi-3/3.5) over a paged KV cache.

Differences between the family members are config switches: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings, rope scaling, explicit head_dim, Mistral's sliding-window attention (each token
sees only the last ``sliding_window`` positions, itself included; the attention backend applies it as a
mask). Qwen2-MoE, Qwen3-MoE and Mixtral are the same decoder whose sparse layers' MLP is a mixture-of-experts
block (``models/moe.py``). Projections are fused (q|k|v and gate|up) so a step runs two GEMMs fewer per layer;
every projection is a plain ``nn.Linear`` so quantization can swap it. Inputs are flat token batches: ``input_ids`` /
``positions`` are ``[T]`` for all scheduled requests of a step.

Tensor parallel (``tensor_parallel``, :mod:`jobrunner.models.parallel`): the same modules at the rank's sizes
(its q / KV heads, its intermediate columns, its vocabulary rows, its experts); ``shape`` holds the rank's
head counts. o_proj and down_proj (or a MoE block) all-reduce their partial sums once; the embedding and the
LM head are vocabulary-parallel (:mod:`jobrunner.models.parallel.layers`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from jobrunner.attention import AttentionMetadata, paged_attention
from jobrunner.models import fused_ops, phi3
from jobrunner.models.heads import split_architecture
from jobrunner.models.layer_loop import run_decode_layers
from jobrunner.models.moe import MoeShape, SparseMoeBlock, moe_shape
from jobrunner.models.parallel import TensorParallel
from jobrunner.models.parallel.layers import gather_logits, parallel_embed, split_shape, vocab_rows
from jobrunner.models.parallel.sizes import ShardPlan
from jobrunner.models.rope import RotaryEmbedding, apply_rotary


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a model config the engine needs."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None = None  # keys a query sees (itself included); None = all earlier positions
    moe: MoeShape | None = None  # Qwen2/3-MoE, Mixtral: which layers are sparse, experts, top-k (models/moe.py)
    # --- Gemma 2/3 (jobrunner.models.gemma.gemma_shape) ---
    layer_windows: tuple[int | None, ...] | None = None  # per layer when layers differ (local / global layers)
    attn_logit_softcapping: float | None = None  # attention scores -> cap * tanh(scores / cap)
    # --- the head on the decoder (models/heads.py): lm | classifier (`score`, num_labels outputs) | none ---
    head: str = "lm"
    num_labels: int = 0

    @classmethod
    def from_config(cls, config) -> ModelShape:
        arch, head = split_architecture((getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0])
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        bias = bool(getattr(config, "attention_bias", False)) or arch == "Qwen2ForCausalLM"
        bias = bias or (arch == "Qwen2MoeForCausalLM" and bool(getattr(config, "qkv_bias", True)))
        if arch == phi3.ARCHITECTURE:
            phi3.check_config(config)
        return cls(
            architecture=arch,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_sliding_window(config, arch),
            moe=moe_shape(config, arch),
            head=head,
            num_labels=int(getattr(config, "num_labels", 0) or 0) if head == "classifier" else 0,
        )


def _sliding_window(config, arch: str) -> int | None:
    """Mistral's and Phi-3's window (every layer); Qwen2/3 windows are per layer (max_window_layers): refused."""
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{arch}: use_sliding_window=true (a window on some layers only) is not supported; "
                         "supported: Mistral's sliding_window on every layer")
    windowed = ("MistralForCausalLM", "MixtralForCausalLM", phi3.ARCHITECTURE)
    window = getattr(config, "sliding_window", None) if arch in windowed else None
    if window is not None and int(window) < 1:
        raise ValueError(f"{arch}: sliding_window must be a positive number of tokens, got {window!r}")
    return None if window is None else int(window)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_ops.rms_norm(x, self.weight, self.eps)
        return fused[0] if fused is not None else self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch ops (what the fused kernel reproduces)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_forward(self, x: torch.Tensor, add: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + add), x + add)``: the residual add and the norm in one pass where fused ops run."""
        fused = fused_ops.rms_norm(x, self.weight, self.eps, add)
        if fused is not None:
            return fused
        total = x + add
        return self.reference(total), total


class Attention(nn.Module):
    # the paged-attention call, as a class attribute: `jobrunner.engine.profile` shadows it per instance to time
    # it (so the profile costs nothing when off)
    attend = staticmethod(paged_attention)
    tp: TensorParallel | None = None  # set on a split model: o_proj's partial sums are all-reduced

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.attention_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; rope: this step's (cos, sin), see RotaryEmbedding.forward
        q, k, v = self.rotated_qkv(x, rope)
        out = self.attend(q, k, v, k_cache, v_cache, meta, self.scale)
        out = self.o_proj(out)
        return out if self.tp is None else self.tp.all_reduce(out)

    def rotated_qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[T, heads, head_dim]`` of ``x``: projected, per-head normed where the model has q/k norms,
        q and k rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if not fused_ops.rotary_(q, k, *rope):  # in place on the qkv row views where it can
            q, k = apply_rotary(q, k, *rope)
        return q, k, v


class MLP(nn.Module):
    tp: TensorParallel | None = None  # set on a split model's dense MLP: down_proj's partial sums are all-reduced

    def __init__(self, shape: ModelShape, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size or shape.intermediate_size
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = fused_ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = nn.functional.silu(gate) * up
        out = self.down_proj(act)
        return out if self.tp is None else self.tp.all_reduce(out)


def make_mlp(shape: ModelShape, layer_index: int, split: tuple[TensorParallel, ShardPlan] | None = None
             ) -> nn.Module:
    """The dense MLP, or for a sparse layer of a MoE model its :class:`~jobrunner.models.moe.SparseMoeBlock`
    (on a split model: the rank's experts and its shard of the shared expert; the block reduces once)."""
    moe = shape.moe
    if moe is None or not moe.is_sparse(layer_index):
        mlp = MLP(shape)
        mlp.tp = split[0] if split else None
        return mlp
    shared_size = split[1].shared_expert_intermediate_size if split else moe.shared_expert_intermediate_size
    shared = MLP(shape, shared_size) if shared_size else None
    if split is None:
        return SparseMoeBlock(shape.hidden_size, moe, shared)
    tp, plan = split
    block = SparseMoeBlock(shape.hidden_size, moe, shared, (plan.expert_start(tp.rank), plan.num_experts))
    block.tp = tp
    return block


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, layer_index: int = 0,
                 split: tuple[TensorParallel, ShardPlan] | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.self_attn.tp = split[0] if split else None
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = make_mlp(shape, layer_index, split)

    def forward(self, x, rope, meta, k_cache, v_cache):
        h = self.self_attn(self.input_layernorm(x), rope, meta, k_cache, v_cache)
        norm = self.post_attention_layernorm
        if isinstance(norm, RMSNorm):  # residual add + norm in one pass (not when wrapped, e.g. row tiling)
            h, x = norm.add_forward(x, h)
        else:
            x = x + h
            h = norm(x)
        return x + self.mlp(h)


def make_embedding(num: int, dim: int) -> nn.Embedding:
    """``nn.Embedding(num, dim)``; built on the meta device (models/loader.build_model), without its random
    init: the first ``normal_`` on a meta tensor costs ~2.5 s (torch imports its compiler's decompositions for
    it), a start-up cost for weights that are loaded right after."""
    if torch.empty(0).device.type == "meta":
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus its head. ``forward`` returns the final (normed) hidden states; ``compute_logits``
    the LM head's logits; ``compute_scores`` a classifier's ``score`` head.

    A ``...ForSequenceClassification`` or bare ``...Model`` checkpoint (``shape.head``) has no LM head unless its
    embeddings are tied (then the tied head is free, and log-likelihoods can still be scored).

    ``tensor_parallel``: build this rank's shard (``shard_plan`` its numbers; None: the whole model).
    """

    lora = None  # the attached LoRA adapters (models/lora.py: AdapterSet), if any
    # the layer, MLP and norm classes whose work models/layer_loop.py knows (a wrapped one runs in Python)
    plain_parts = (DecoderLayer, MLP, RMSNorm)

    def __init__(self, config, max_positions: int | None = None,
                 tensor_parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.shape, self.shard_plan = split_shape(ModelShape.from_config(config), tensor_parallel)
        self.tensor_parallel = tensor_parallel if self.shard_plan is not None else None
        s, split = self.shape, (tensor_parallel, self.shard_plan) if self.shard_plan is not None else None
        self.rotary = RotaryEmbedding(config, s.head_dim, max_positions or s.max_position_embeddings)
        rows = vocab_rows(s, self.shard_plan)
        self.embed_tokens = make_embedding(rows, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s, i, split) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        has_lm_head = s.head == "lm" or s.tie_word_embeddings
        self.lm_head = nn.Linear(s.hidden_size, rows, bias=False) if has_lm_head else None
        self.score = nn.Linear(s.hidden_size, s.num_labels, bias=False) if s.head == "classifier" else None
        if s.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the norms' weights keep it whatever quantization did to the other layers)."""
        return self.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        # kv_cache: [num_layers, 2, num_slots, num_kv_heads, head_dim]
        tp = self.tensor_parallel
        x = self.embed_inputs(input_ids)
        rope = self.rotary(positions, x.dtype)  # the same cos/sin for every layer: gathered once
        if x.is_cpu and x.dtype == torch.bfloat16 and tp is None:  # AMX decode: every layer in one native call
            # (not on a split model: the native loop has no all-reduce)
            hidden = run_decode_layers(self, x, rope, meta, kv_cache)
            if hidden is not None:
                return hidden
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, meta, kv_cache[i, 0], kv_cache[i, 1])
        return self.norm(x)

    def embed_inputs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The step's token embeddings ``[T, hidden]`` (a vision-language model puts image vectors in them)."""
        tp = self.tensor_parallel
        return self.embed_tokens(input_ids) if tp is None else parallel_embed(self.embed_tokens, input_ids, tp,
                                                                              self.shard_plan)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            raise ValueError(f"{self.shape.architecture} checkpoint with head {self.shape.head!r} has no LM head")
        logits = self.lm_head(hidden)
        tp = self.tensor_parallel
        return logits if tp is None else gather_logits(logits, tp, self.shape.vocab_size)

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """The classifier head on hidden states ``[rows, hidden]`` -> ``[rows, num_labels]``."""
        if self.score is None:
            raise ValueError(f"{self.shape.architecture} checkpoint has no classification (score) head")
        return self.score(hidden)
