"""bf16 prompt chunks on the AMX matrix units, straight from the paged KV cache
(``kernels/csrc/attention/amx_attention.c``).

On a CPU with AMX, the ``cpu_paged`` backend sends bf16 prompt chunks of more than ``AMX_MIN_QUERY`` tokens
here instead of to torch's SDPA (which needed each row's keys gathered out of the cache and, after a cached
prefix, a mask it reads per score without skipping a tile). The kernel's layout and arithmetic are in its
header: scores and softmax in float32, P in bf16 into the second product, as torch's CPU flash attention
does for bf16. Outside deterministic mode only (``engine.deterministic`` keeps every row on the exact kernel).

On a CPU with AVX-512 BF16 and no AMX (AMD Zen 4 / Zen 5) the same source is built without tiles: the
layout, the online softmax and the bf16 P are the AMX kernel's, the products ``vdpbf16ps`` reading their
operands in place. Prompt blocks: ``include/jr_prompt_avx512.h`` (they first ran on tiles emulated in memory,
``include/jr_tile_avx512.h``, which copied both operands of every product; for D = 64 the same bits). Measured
on a 2-core AMD EPYC Zen 4 (SmolLM2-135M bf16, 32 long few-shot prompts of ~2,000 tokens x 32 output tokens,
``bench --profile``): prompt steps' attention 1,427 ms/step on the native kernel's float32 FMAs, 976 on
emulated tiles, ~700 now (~58% of the cores' bf16 rate). Decodes: ``include/jr_decode_avx512.h`` (a tile's 16
lanes held 3 query heads of a decode, so most of its arithmetic was padding): ShareGPT decode-step attention
38.8 -> 10.5 ms (docs/engine.md).

Chosen by capability (``amx``, ``avx512_bf16``); ``JOBRUNNER_ATTENTION_AMX=0`` turns it off (long chunks then
take torch's SDPA with AMX, the native kernel without). A CPU without either, a compiler without the ISA's
flags, a head_dim that is not a multiple of 32, or an OS that refuses the tile state:
:func:`amx_unavailable_reason` says why and the other route stays.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from jobrunner.kernels import (
    SWITCHES,
    capability_key,
    capability_switch,
    detect_cpu_capability,
    load,
    source_path,
    switch,
)

AMX_ENV = "JOBRUNNER_ATTENTION_AMX"
AMX_MIN_QUERY = 1  # every chunk of 2+ tokens: from 2 tokens up as fast as the fast kernel or faster (2-core Xeon)
SOURCE = source_path("amx_attention")
_P, _I = ctypes.c_void_p, ctypes.c_int64


# the library of each capability that runs the kernels: the tiles, or the same source with the tile operations
# on AVX-512 BF16 (kernels/csrc/include/jr_tile_avx512.h)
LIBRARIES = {"amx": "amx_attention", "avx512_bf16": "bf16_attention"}
# where the kernels are the default route (AVX-512 BF16: measured in the module doc)
DEFAULT_ON = frozenset({"amx", "avx512_bf16"})


def _library() -> ctypes.CDLL | str:
    """This capability's build of the kernels (detected or forced), or why there is none."""
    return _library_of(capability_key())


@functools.cache
def _library_of(key: str) -> ctypes.CDLL | str:
    capability, _ = detect_cpu_capability()
    if capability not in LIBRARIES:
        return f"AMX prompt attention needs a CPU with AMX or AVX-512 BF16 (capability {capability})"
    return load(LIBRARIES[capability])


def amx_unavailable_reason(head_dim: int) -> str | None:
    """Why the AMX kernel cannot run here (``None`` when it can): capability, head_dim, build, OS."""
    capability, _ = detect_cpu_capability()
    if capability not in LIBRARIES:
        return f"AMX prompt attention needs a CPU with AMX or AVX-512 BF16 (capability {capability})"
    if head_dim % 32:
        return f"AMX prompt attention needs head_dim % 32 == 0 (got {head_dim})"
    lib = _library()
    return lib if isinstance(lib, str) else None


def amx_chunk_route(head_dim: int) -> tuple[bool, str]:
    """``(send long bf16 prompt chunks to the AMX kernel, why)``: the capability rule and the setting, then
    whether the kernel can run here at all."""
    use, why = capability_switch(AMX_ENV, DEFAULT_ON,
                                 f"bf16 prompt chunks of more than {AMX_MIN_QUERY} tokens on the AMX kernel",
                                 "bf16 prompt chunks off the AMX kernel")
    if not use:
        return False, why
    reason = amx_unavailable_reason(head_dim)
    return (False, reason) if reason else (True, why)


AMX_DECODE_ENV = "JOBRUNNER_ATTENTION_AMX_DECODE"
AMX_DECODE_MODES = SWITCHES[AMX_DECODE_ENV].choices  # ("grouped", "all", "0")


# head sizes the decode kernel takes per capability: the tiles' D = 64; without AMX (include/jr_decode_avx512.h)
# 64 and 128 (Llama-3, Qwen2.5 from 1.5B up)
DECODE_HEAD_DIMS = {"amx": (64,), "avx512_bf16": (64, 128)}


def amx_decode_route(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> str:
    """Whether bf16 decodes take the AMX kernel where prompt chunks do: ``"grouped"`` (the default: decodes that
    share a cached prefix read it once per group), ``"all"`` (each row reads all its keys) or ``""`` (none:
    ``JOBRUNNER_ATTENTION_AMX_DECODE=0``, or a shape the decode kernel does not take: a head_dim of
    :data:`DECODE_HEAD_DIMS` for this capability, at most 16 query heads per kv head, blocks of a multiple of 16
    tokens)."""
    mode = switch(AMX_DECODE_ENV)  # ValueError naming the variable unless one of AMX_DECODE_MODES
    capability, _ = detect_cpu_capability()
    fits = head_dim in DECODE_HEAD_DIMS.get(capability, ()) and num_kv_heads > 0 and num_heads % num_kv_heads == 0 and \
        num_heads // num_kv_heads <= 16 and block_size > 0 and block_size % 16 == 0
    return mode if mode != "0" and fits else ""


class AmxPromptAttention:
    """The kernel with its reusable workspace (the staged keys and values of one call's rows)."""

    def __init__(self) -> None:
        lib = _library()
        if isinstance(lib, str):
            raise RuntimeError(lib)
        self.fn = lib.jr_amx_prompt_attention
        self.decode_fn = lib.jr_amx_decode_attention
        self.workspace = torch.empty(0, dtype=torch.uint8)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 rows: tuple[torch.Tensor, ...], max_blocks: int, num_rows: int, padded_keys: int,
                 block_size: int, scale: float) -> None:
        """Write the attention of ``num_rows`` prompt chunks into ``out`` ``[T, H * D]``; ``rows`` are int64
        query_start, query_len, seq_len and block tables ``[rows * max_blocks]``; ``padded_keys`` the sum of
        the rows' key counts rounded up to 32 (sizes the workspace)."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[1]
        workspace = self.workspace_for(padded_keys, num_kv_heads, head_dim)
        start, length, seq, tables = rows
        rc = self.fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), start.data_ptr(),
                     length.data_ptr(), seq.data_ptr(), tables.data_ptr(), max_blocks, num_rows, num_heads,
                     num_kv_heads, head_dim, block_size, scale, workspace.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"AMX prompt attention failed (code {rc}: 1 bad shape, 3 AMX refused by the OS)")

    def workspace_for(self, padded_keys: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
        """The workspace, grown to hold a call's staged bf16 values (``padded_keys`` as in ``__call__``)."""
        need = padded_keys * num_kv_heads * head_dim * 2
        if self.workspace.numel() < need:
            self.workspace = torch.empty(need, dtype=torch.uint8)
        return self.workspace

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
               rows: tuple[torch.Tensor, ...], max_blocks: int, num_rows: int, num_groups: int, block_size: int,
               scale: float) -> None:
        """Write the attention of ``num_rows`` decodes (one query token each) into ``out``; ``rows`` are int64
        query_start, seq_len, block tables ``[rows * max_blocks]``, then the ``num_groups`` groups sharing
        cached keys (member offsets, members, shared keys; see ``cpu_paged._queue_groups``)."""
        start, seq, tables, group_off, group_rows, group_len = rows
        rc = self.decode_fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), start.data_ptr(),
                            seq.data_ptr(), tables.data_ptr(), max_blocks, num_rows, q.shape[1], k_cache.shape[1],
                            q.shape[2], block_size, scale, torch.get_num_threads(), num_groups,
                            group_off.data_ptr(), group_rows.data_ptr(), group_len.data_ptr())
        if rc:
            raise RuntimeError(f"AMX decode attention failed (code {rc}: 1 bad shape, 2 out of memory, "
                               "3 AMX refused by the OS)")
