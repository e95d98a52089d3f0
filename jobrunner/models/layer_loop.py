"""A step's decoder layers in one native call, on CPUs with AMX or AVX-512 BF16 (``kernels/csrc/layer_loop.c``; its
structs and the kernels' prototypes in ``kernels/csrc/include/jr_kernels.h``, mirrored by
:mod:`jobrunner.kernels.signatures`).

On a small model a CPU decode step is ~11 native kernels per layer, each reached from Python (``nn.Module``
calls, argument checks, ``ctypes``); sampled on SmolLM2-135M (64 rows, bf16, 2 cores) about a quarter of the
main thread's time went there while the second core waited at the next parallel region. For the steps where
every kernel of a layer is a native one, :func:`run_decode_layers` calls them back to back from C with the
arguments the Python path would give them, so a step's hidden states are that path's bits (tested).

It applies to a step when all of these hold, else the layers run in Python as before:

* the model (once): a plain Llama-family decoder (Llama, Mistral without a window, Qwen2) with dense MLPs,
  no q/k norms, no LoRA adapters attached, bf16, head_dim 64 or 128, every projection on the packed bf16 GEMM
  (``models/amx_linear.py``: the AMX tiles, or AVX-512 BF16 dot products on CPUs without AMX) or on the W8A8
  VNNI kernel (``quant/i8_gemm.py``: ``w8a8`` on avx512_bf16; any mix, each layer's projection called through
  its own kernel), the fused ops and the kernels built;
* the step: at most the packed GEMM's row limit (``AMX_GEMM_MAX_ROWS`` with AMX; ``LOOP_MAX_ROWS`` with
  AVX-512 BF16, whose GEMM takes prompt chunks too) tokens on the ``cpu_paged`` backend (bf16 KV cache, no sliding
  window, nothing routed to torch's SDPA), rotary tables ``[rows, 1, head_dim]``. Its rows take the kernels the
  backend routes them to: decodes the tile decode kernel where it takes the head size (AMX: 64; AVX-512 BF16: 64
  and 128), else the native kernel; chunks (speculative verify rows, the tail of a chunked prompt; every prompt
  chunk without AMX) the prompt kernel; short rows the native kernel. head_dim 128 (Llama-3, Qwen2.5 from 1.5B
  up): a random model of that head size (16 layers, hidden 1024, 8 heads / 2 kv heads, 231 M), ShareGPT 64 x 64
  on a 2-core Zen 4, loop on 366.3 / 362.4 out tok/s, off 294.5 / 334.6 (alternated).

``JOBRUNNER_LAYER_LOOP=0`` turns it off. Under ``jobrunner bench --profile`` the C loop times its kernels
itself (attention, GEMMs, other) and the profiler charges them (``engine/profile.py``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from jobrunner.kernels import LoopLayer as _Layer
from jobrunner.kernels import LoopModel as _Model
from jobrunner.kernels import LoopRows as _Rows
from jobrunner.kernels import LoopStep as _Step
from jobrunner.kernels import is_off, load, source_path

LOOP_ENV = "JOBRUNNER_LAYER_LOOP"
LOOP_MAX_ROWS = 2048  # the most tokens of a step in the loop where the packed GEMM takes any row count
SOURCE = source_path("layer_loop")
ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
_STAGES = ("input norm", "q|k|v projection", "rotary", "KV write", "decode attention", "o projection",
           "post-attention norm", "gate|up projection", "SiLU * up", "down projection")


def _rows(num_rows: int, max_blocks: int, tensors: dict[str, torch.Tensor], num_groups: int = 0) -> _Rows:
    """One attention kernel's rows (none: zeros, the tensors unread)."""
    if not num_rows:
        return _Rows()
    return _Rows(num_rows=num_rows, max_blocks=max_blocks, num_groups=num_groups,
                 **{name: t.data_ptr() for name, t in tensors.items()})


@functools.cache
def _library() -> ctypes.CDLL | str:
    return load("layer_loop")


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _projection_kind(proj) -> str | None:
    """``"bf16"`` (the packed bf16 GEMM), ``"vnni"`` / ``"amx"`` (our W8A8 GEMM) or None (neither: no loop)."""
    from jobrunner.models.onednn_linear import OneDnnLinear
    from jobrunner.quant.int4 import Int4WeightOnlyLinear
    from jobrunner.quant.w8a8 import W8A8Linear

    if type(proj) is OneDnnLinear and proj.amx_packed is not None:
        return "bf16"
    if type(proj) is W8A8Linear and proj.vnni_packed is not None:
        return proj.kernel  # "vnni" | "amx": our W8A8 GEMM
    if type(proj) is Int4WeightOnlyLinear and proj.int8 is not None and proj.int8.kernel is not None:
        return "int4"  # W4A8 on our W8A8 GEMM (quant/int4_int8.py), for steps above its tinygemm rows
    return None


def _int4_projections(model) -> list:
    """The model's projections on the int4 W4A8 kernel (their scratch pointers are refreshed per step)."""
    return [p for layer in model.layers for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if _projection_kind(p) == "int4"]


def _projection(proj) -> tuple[int, int]:
    """(the packed weight's address, the address of the linear kernel that reads it)."""
    from jobrunner.models import amx_linear
    from jobrunner.quant import i8_gemm

    kind = _projection_kind(proj)
    if kind in ("vnni", "amx"):
        return proj.vnni_packed.data_ptr(), i8_gemm.linear_address(proj.kernel)
    if kind == "int4":
        return ctypes.addressof(proj.int8.bind()), _address(proj.int8.linear_fn)
    return proj.amx_packed.data_ptr(), _address(amx_linear.linear_function(amx_linear._library()))


def layer_loop_reason(model) -> str | None:
    """Why ``model`` cannot run its decode steps' layers in the C loop (None: it can, given a step that fits)."""
    from jobrunner.models import amx_linear, fused_ops
    from jobrunner.quant import i8_gemm

    if is_off(LOOP_ENV):
        return f"{LOOP_ENV}=0"
    parts = getattr(model, "plain_parts", None)
    if parts is None:
        return f"{type(model).__name__}: not the Llama-family decoder"
    DecoderLayer, MLP, RMSNorm = parts  # noqa: N806 (classes)
    s = model.shape
    if s.architecture not in ARCHITECTURES or s.qk_norm or s.moe is not None or s.sliding_window is not None \
            or s.layer_windows is not None or s.attn_logit_softcapping is not None or s.head_dim not in (64, 128):
        return f"{s.architecture} (head_dim {s.head_dim}): not a plain Llama-family decoder with 64- or 128-dim heads"
    if model.dtype != torch.bfloat16 or model.norm.weight.device.type != "cpu":
        return "not a bf16 model on CPU"
    kinds = set()
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if type(layer) is not DecoderLayer or type(mlp) is not MLP or any(type(n) is not RMSNorm for n in norms):
            return "a layer that is not the plain decoder layer (wrapped or replaced)"
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            kind = _projection_kind(proj)
            if kind is None:
                return "a projection on neither the packed bf16 GEMM nor the W8A8 VNNI kernel"
            kinds.add(kind)
        if mlp.down_proj.bias is not None or mlp.gate_up_proj.bias is not None or attn.o_proj.bias is not None:
            return "a bias outside q|k|v"
    libraries = [fused_ops.fused_library(), _library()]
    libraries += [amx_linear._library()] if "bf16" in kinds else []
    libraries += [i8_gemm.library(k) for k in kinds if k in i8_gemm.LIBRARIES]
    libraries += [i8_gemm.library(p.int8.kernel) for p in _int4_projections(model)]
    for lib in libraries:
        if isinstance(lib, str):
            return lib
    return None


class LayerLoop:
    """The C loop's view of one model: kernels, shapes, per-layer weights (see the module doc)."""

    def __init__(self, model) -> None:
        from jobrunner.models import amx_linear, fused_ops
        s = model.shape
        fused = fused_ops.fused_library()
        self.fn = _library().jr_layer_loop
        self.model = _Model(norm=_address(fused.jr_rms_norm),
                            rotary=_address(fused.jr_rotary), silu=_address(fused.jr_silu_mul),
                            hidden=s.hidden_size, heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                            inter=model.layers[0].mlp.intermediate_size, layers=s.num_layers,
                            eps=s.rms_norm_eps, scale=model.layers[0].self_attn.scale)
        self.max_rows = amx_linear.packed_max_rows() or LOOP_MAX_ROWS
        # int4 projections: the loop runs their W4A8 kernel, which the Python path takes only above the layer's
        # tinygemm rows and up to its int8 limit; steps outside that stay in Python (the same bits either way)
        self.int4 = _int4_projections(model)
        self.int4_generation: tuple[int, ...] | None = None  # their scratch generations when last bound
        self.min_rows = 1 + max((p.small_batch_max_tokens for p in self.int4), default=0)
        self.max_rows = min([self.max_rows] + [p.int8.max_tokens for p in self.int4])
        self.source = model
        self.kernels_of: int | None = None  # id of the backend whose write / decode kernels are set
        self.layers_of: tuple[int, int] | None = None  # (data_ptr, layer stride) of the KV cache the layers see
        self.layers = (_Layer * s.num_layers)()
        # the step's bf16 buffers, each as many rows as the largest step so far (up to max_rows) of its width,
        # 64-byte aligned, in one workspace
        m = self.model
        q_size, kv_size = m.heads * m.head_dim, m.kv_heads * m.head_dim
        self.widths = {"x0": m.hidden, "x1": m.hidden, "h": m.hidden, "qkv": q_size + 2 * kv_size, "q": q_size,
                       "attn": q_size, "o": m.hidden, "gate_up": 2 * m.inter, "act": m.inter, "down": m.hidden}
        self.workspace = torch.empty(0, dtype=torch.bfloat16)
        self.workspace_rows = 0

    def _buffers(self, rows: int) -> dict[str, int]:
        """The step's buffer addresses in the workspace, grown to ``rows`` rows first where it is smaller."""
        if rows > self.workspace_rows:
            grown = max(rows, min(self.max_rows, 2 * self.workspace_rows))
            self.workspace = torch.empty(grown * sum(self.widths.values()) + 32 * len(self.widths),
                                         dtype=torch.bfloat16)
            self.workspace_rows = grown
        at, buffers = -(-self.workspace.data_ptr() // 64) * 64, {}
        for name, width in self.widths.items():
            buffers[name] = at
            at += -(-rows * width * 2 // 64) * 64
        return buffers

    def applies(self, x: torch.Tensor, rope, meta, kv_cache: torch.Tensor) -> bool:
        """Whether this step fits the loop (module doc), from cheap checks of its tensors and metadata."""
        from jobrunner.attention.cpu_paged import CpuPagedMetadata

        if type(meta) is not CpuPagedMetadata or meta.torch_groups:
            return False
        rows = x.shape[0]
        if meta.num_tokens != rows or not self.min_rows <= rows <= self.max_rows or meta.window or \
                getattr(meta, "layer_views", None) is not None:
            return False
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or kv_cache.dtype != torch.bfloat16 or \
                not kv_cache.is_contiguous() or meta.slot_mapping.dtype != torch.int64:
            return False
        cos, sin = rope
        d = self.model.head_dim
        return all(t.dtype == torch.bfloat16 and t.shape == (rows, 1, d) and t.is_contiguous() for t in (cos, sin))

    def run(self, x: torch.Tensor, rope, meta, kv_cache: torch.Tensor, clock=None) -> torch.Tensor:
        """The final (normed) hidden states of the decode step whose embeddings are ``x``."""
        self._bind(meta.backend, kv_cache)
        generation = tuple(proj.scratch.generation for proj in self.int4)
        if generation != self.int4_generation:
            for proj in self.int4:  # a scratch moved (grown for a larger layer): rebind in place
                proj.int8.bind()
            self.int4_generation = generation
        m, rows = self.model, x.shape[0]
        out = torch.empty_like(x)
        buffers = self._buffers(rows)
        cos, sin = rope
        amx = meta.backend.amx  # None without AMX: every row on the native kernel, no workspace
        workspace = amx.workspace_for(meta.amx_padded_keys, m.kv_heads, m.head_dim) if amx is not None else None
        decodes = _rows(meta.amx_num_decodes, meta.amx_decode_blocks, dict(zip(
            ("start", "seq", "tables", "group_off", "group_rows", "group_len"), meta.amx_decodes)),
            meta.amx_decode_groups)
        natives = _rows(meta.num_rows, meta.max_blocks, dict(zip(
            ("start", "len", "seq", "tables", "group_off", "group_rows", "group_len", "key_start"),
            meta.rows + meta.shared)), meta.num_shared)
        chunks = _rows(meta.amx_num_rows, meta.amx_max_blocks, dict(zip(("start", "len", "seq", "tables"),
                                                                         meta.amx_rows)))
        step = _Step(rows=rows, threads=torch.get_num_threads(), x=x.data_ptr(), out=out.data_ptr(),
                     cos=cos.data_ptr(), sin=sin.data_ptr(), slots=meta.slot_mapping.data_ptr(),
                     block_size=meta.block_size, fast_min_query=meta.backend.fast_min_query or 0,
                     decodes=decodes, natives=natives, chunks=chunks,
                     workspace=None if workspace is None else workspace.data_ptr(),
                     final_norm=self.source.norm.weight.data_ptr(), **buffers)
        seconds = (ctypes.c_double * 3)() if clock is not None else None
        rc = self.fn(ctypes.byref(m), self.layers, ctypes.byref(step), seconds)
        if rc:
            layer, stage = divmod(rc, 100)
            what = "final norm" if layer > m.layers else _STAGES[stage - 1]
            raise RuntimeError(f"layer loop: the {what} kernel of layer {layer - 1} refused its call (code {rc})")
        if clock is not None:
            clock.charge("attention", seconds[0])
            clock.charge("gemm", seconds[1])
        return out

    def _bind(self, backend, kv_cache: torch.Tensor) -> None:
        """Point the loop at this backend's KV-write and decode kernels and at this cache's layer views."""
        if self.kernels_of != id(backend):
            m = self.model
            m.write_kv, m.native = _address(backend.write_fn), _address(backend.fn)
            amx = backend.amx
            m.decode, m.chunk = (None, None) if amx is None else (_address(amx.decode_fn), _address(amx.fn))
            self.kernels_of = id(backend)
        key = (kv_cache.data_ptr(), kv_cache.stride(0))
        if self.layers_of == key:
            return
        for i, layer in enumerate(self.source.layers):
            attn, mlp = layer.self_attn, layer.mlp
            bias = attn.qkv_proj.bias
            (qkv, qkv_fn), (o, o_fn), (gate_up, gate_up_fn), (down, down_fn) = (
                _projection(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            self.layers[i] = _Layer(
                in_norm=layer.input_layernorm.weight.data_ptr(),
                post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                qkv=qkv, qkv_bias=None if bias is None else bias.data_ptr(), o=o, gate_up=gate_up, down=down,
                qkv_fn=qkv_fn, o_fn=o_fn, gate_up_fn=gate_up_fn, down_fn=down_fn,
                k_cache=kv_cache[i, 0].data_ptr(), v_cache=kv_cache[i, 1].data_ptr())
        self.layers_of = key


def run_decode_layers(model, x: torch.Tensor, rope, meta, kv_cache: torch.Tensor) -> torch.Tensor | None:
    """The model's final hidden states for this step through the C loop, or None where the layers must run in
    Python (the model or the step does not fit: module doc). The model's verdict is kept on it."""
    loop = model.__dict__.get("_layer_loop")
    if loop is None:
        reason = layer_loop_reason(model)
        loop = model.__dict__["_layer_loop"] = reason if reason else LayerLoop(model)
    if isinstance(loop, str) or model.lora is not None or torch.is_grad_enabled():
        return None
    if not loop.applies(x, rope, meta, kv_cache):
        return None
    return loop.run(x, rope, meta, kv_cache, model.__dict__.get("layer_loop_clock"))
