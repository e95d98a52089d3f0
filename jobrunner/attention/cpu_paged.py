"""The ``cpu_paged`` backend: paged attention in native code that reads the KV cache in place (CPU only).

The torch backend copies every row's whole K/V history out of the cache into a padded buffer in every layer
of every step; this one walks each row's block table from C (``kernels/csrc/attention/paged_attention.c``:
the algorithm and its fixed reduction order are described there), so a decode step reads each cached key and
value once per layer and copies nothing. One call per layer covers the whole step: decodes (query heads of one kv head
folded, online softmax over the row's blocks, split-K over fixed partitions when there are fewer (row, kv
head) pairs than threads), prompt chunks after a cached prefix and later chunks of chunked prefill
(flash-style key tiles, causal by position), sliding windows, float32 and bfloat16, and fp8 caches
(``engine.kv_cache_dtype``: every tile's codes widened times their row scales where the kernel loads it; the
AMX kernels read bf16 caches only, so an fp8 cache never takes them).

Per-layer windows (``StepLayout.layer_windows``, Gemma 2/3): the window is an argument of each kernel call, so
the step's rows are uploaded once and each distinct window gets a view that differs only in that argument (and
in the torch groups of long chunks, built per window); decodes sharing prefix blocks are not grouped in such
steps. Attention logit soft-capping is not in the kernel (``supports_softcap`` False): the model runner routes
models that need it (Gemma 2) to the torch backend and says so.

Two faster paths sit beside that exact kernel in the same call, on AVX-512 and AVX2 builds and outside
deterministic mode: prompt chunks on a kernel with query vectors in the vector lanes, and decodes that share
cached prefix blocks reading them once per group (see the constants below and docs/engine.md).

On the exact kernel a query's arithmetic depends only on its own query vector and keys (partitions and tiles
sit at absolute key positions), so it is batch-invariant and ``engine.deterministic`` keeps it (with the
faster paths off). The C source is built
by :func:`jobrunner.kernels.load` for this CPU's capability (``-march`` of
``JOBRUNNER_CPU_CAPABILITY`` when forced). No compiler, a failed build, ``JOBRUNNER_ATTENTION_NATIVE=0``, a
CUDA device or a head_dim that is not a multiple of 16: :func:`cpu_paged_unavailable_reason` says why and
:func:`~jobrunner.attention.make_backend` raises, and the model runner uses the torch backend instead.
"""

from __future__ import annotations

import copy
import ctypes
import functools

import torch

from jobrunner.attention.amx_prefill import AMX_MIN_QUERY, AmxPromptAttention, amx_chunk_route, amx_decode_route
from jobrunner.attention.base import AttentionBackend, AttentionMetadata, StepLayout, layer_views, write_kv
from jobrunner.attention.torch_backend import TORCH_BACKEND, attend_groups
from jobrunner.attention.upload import StepUpload
from jobrunner.kernels import capability_switch, detect_cpu_capability, is_off, load, source_path

NATIVE_ENV = "JOBRUNNER_ATTENTION_NATIVE"
FAST_ENV = "JOBRUNNER_ATTENTION_FAST"  # 0: the portable build's choice everywhere (exact kernel + SDPA for long chunks)
SOURCE = source_path("paged_attention")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
FP8_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernel's kv_fp8 codes (0: q's dtype)


@functools.cache
def _library(capability: str) -> ctypes.CDLL | str:
    """The built kernel for ``capability`` (a cache key only: the build reads the capability itself), or why not."""
    return load("paged_attention")


def native_library() -> ctypes.CDLL | str:
    """The compiled library for the current CPU capability (detected or forced), or the reason there is none."""
    if is_off(NATIVE_ENV):
        return f"{NATIVE_ENV}=0"
    capability, forced = detect_cpu_capability()
    return _library(f"{capability}:{forced}")


def cpu_paged_unavailable_reason(device, head_dim: int) -> str | None:
    """Why the backend cannot run here (``None`` when it can)."""
    if torch.device(device).type != "cpu":
        return f"cpu_paged attention runs on CPU only (device {device})"
    if head_dim % 16:
        return f"cpu_paged attention needs head_dim % 16 == 0 (got {head_dim})"
    lib = native_library()
    return lib if isinstance(lib, str) else None


# Which kernel a row of several query tokens takes (a decode always takes the exact kernel):
# - on AVX-512 builds (two zmm registers of query lanes per item) and AVX2 builds (one ymm register), the fast
#   prompt-chunk kernel for every row of >= FAST_MIN_QUERY tokens: on AVX-512, 1.2-2.5x the torch groups'
#   gather + SDPA on Emerald Rapids, float32 and bf16 (docs/engine.md); on AVX2, measured end to end on a
#   2-core AMD Zen 3 (float32, 2026-12-03): prompt-step attention of the long few-shot set 1.48 -> 1.27 s, and
#   every benchmark set faster (docs/bench.md);
# - on the portable build (4 lanes) chunks of more than NATIVE_MAX_QUERY tokens take the torch groups and
#   shorter ones the exact kernel (at 8 tokens both cost the same on Zen 3).
# Deterministic mode: every row on the exact kernel, so a token's bits never depend on how its prompt was
# chunked (native_max_query None, fast_min_query 0).
NATIVE_MAX_QUERY = 8
FAST_MIN_QUERY = 2
FAST_MIN_LANES = 8
# Decodes whose rows share cached prefix blocks read those keys once for the whole group (on the fast kernel,
# their queries in its lanes; on Zen 3 the long few-shot set's decode attention went 260 -> 166 ms/step) and
# only their own keys one by one; with the fast kernel only (not in deterministic mode),
# JOBRUNNER_ATTENTION_SHARED=0 turns it off.
SHARED_ENV = "JOBRUNNER_ATTENTION_SHARED"
SHARED_MIN_KEYS = 128
# bf16 on CPUs with AMX: prompt chunks of more than BF16_SDPA_MIN_QUERY tokens go to the torch groups, whose
# bf16 SDPA multiplies on the matrix units (torch's CPU flash attention): 463 vs ~255 GFLOP/s for our fast
# kernel (float32 arithmetic) on a 2-core Xeon with AMX; the long few-shot set's prompt steps' attention went
# 604 -> 465 ms/step (docs/engine.md). Shorter chunks and the shared-prefix decodes stay on the fast kernel.
# Chosen by capability (amx, where it was measured); JOBRUNNER_ATTENTION_BF16_SDPA=0 / 1 turns it off / on.
BF16_SDPA_ENV = "JOBRUNNER_ATTENTION_BF16_SDPA"
BF16_SDPA_MIN_QUERY = 64
BF16_SDPA_CAPABILITIES = frozenset({"amx"})


class CpuPagedMetadata(AttentionMetadata):
    """One step's rows for the kernel (int64 views of the step upload) and the torch groups of the long chunks."""

    def __init__(self, backend: CpuPagedBackend, t: dict[str, torch.Tensor], native: StepLayout, max_blocks: int,
                 torch_groups: list, num_shared: int = 0) -> None:
        self.backend = backend
        self.slot_mapping = t["slot_mapping"]
        self.num_tokens = native.num_tokens
        self.rows = (t["cp_start"], t["cp_len"], t["cp_seq"], t["cp_tables"])  # [R], [R], [R], [R * max_blocks]
        self.num_rows = native.num_rows
        self.max_blocks = max_blocks
        self.block_size = native.block_size
        self.window = native.sliding_window or 0
        self.torch_groups = torch_groups
        self.num_shared = num_shared  # groups of decodes reading their shared prefix blocks once
        self.shared = (t["cp_goff"], t["cp_grows"], t["cp_glen"], t["cp_kstart"])
        self.amx_rows: tuple[torch.Tensor, ...] = ()  # long bf16 chunks for the AMX kernel: start, len, seq, tables
        self.amx_num_rows = self.amx_max_blocks = self.amx_padded_keys = 0
        self.amx_decodes: tuple[torch.Tensor, ...] = ()  # decodes for the AMX kernel: start, seq, tables
        self.amx_num_decodes = self.amx_decode_blocks = self.amx_decode_groups = 0


class CpuPagedBackend(AttentionBackend):
    """In-place paged attention through the native kernel (see the module doc).

    ``native_max_query``: rows with more new tokens go through the torch backend's SDPA groups instead
    (``None``: none do); ``fast_min_query``: rows with at least that many take the fast prompt-chunk kernel
    (0: none do). Both default by the build's vector width (module comment); deterministic mode sets
    ``None`` and 0.
    """

    name = "cpu_paged"
    supports_layer_windows = True

    def __init__(self, lib: ctypes.CDLL, native_max_query: int | None = None, fast_min_query: int | None = None
                 ) -> None:
        self.fn = lib.jr_paged_attention
        self.write_fn = lib.jr_write_kv
        self.lanes = int(lib.jr_fast_lanes())
        wide = self.lanes >= FAST_MIN_LANES and not is_off(FAST_ENV)
        self.fast_min_query = (FAST_MIN_QUERY if wide else 0) if fast_min_query is None else fast_min_query
        self.native_max_query = (None if wide else NATIVE_MAX_QUERY) if native_max_query is None else native_max_query
        self.share_prefixes = not is_off(SHARED_ENV)
        self.amx: AmxPromptAttention | None = None  # long bf16 chunks on the AMX kernel (make_cpu_paged_backend)
        self.amx_decode = ""  # "grouped" / "all": bf16 decodes on the AMX kernel too ("": none)

    def build(self, layout: StepLayout, upload: StepUpload) -> CpuPagedMetadata:
        native, long_chunks = _split_rows(layout, self.native_max_query)
        shared = shared_prefix_groups(native) if self.fast_min_query and self.share_prefixes else []
        decodes = None
        if self.amx_decode and not layout.smallest_window:  # decodes on the AMX kernel, shared prefixes grouped
            native, decodes = _partition(native, lambda i: native.query_lens[i] == 1)
            shared = []  # the native kernel's groups are of decodes, and they all left
            if decodes.num_rows:
                amx_dec_blocks = _queue_rows(upload, "ad", decodes)
                groups = shared_prefix_groups(decodes) if self.amx_decode == "grouped" else []
                _queue_groups(upload, "ag", groups)
        max_blocks = _queue_rows(upload, "cp", native)
        offsets, members, lengths, key_start = [0], [], [], [0] * native.num_rows
        for rows, length in shared:
            members += rows
            offsets.append(len(members))
            lengths.append(length)
            for row in rows:
                key_start[row] = length
        upload.add("cp_goff", offsets)
        upload.add("cp_grows", members or [0])
        upload.add("cp_glen", lengths or [0])
        upload.add("cp_kstart", key_start or [0])
        on_amx = bool(long_chunks.num_rows) and self.amx is not None and not layout.smallest_window
        if on_amx:
            amx_blocks = _queue_rows(upload, "am", long_chunks)
        torch_meta = TORCH_BACKEND.build(long_chunks, upload) if long_chunks.num_rows and not on_amx else None
        meta = CpuPagedMetadata(self, upload.flush(), native, max_blocks,
                                torch_meta.groups if torch_meta else [], len(shared))
        if decodes is not None and decodes.num_rows:
            t = upload.flush()
            meta.amx_decodes = (t["ad_start"], t["ad_seq"], t["ad_tables"], t["ag_off"], t["ag_rows"], t["ag_len"])
            meta.amx_num_decodes, meta.amx_decode_blocks = decodes.num_rows, amx_dec_blocks
            meta.amx_decode_groups = len(groups)
        if on_amx:
            t = upload.flush()
            meta.amx_rows = (t["am_start"], t["am_len"], t["am_seq"], t["am_tables"])
            meta.amx_num_rows, meta.amx_max_blocks = long_chunks.num_rows, amx_blocks
            meta.amx_padded_keys = sum(-(-n // 32) * 32 for n in long_chunks.seq_lens)
        if layout.layer_windows is not None:
            meta.layer_views = layer_views(layout, {w: _window_view(meta, torch_meta, layout, w)
                                                    for w in layout.windows})
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuPagedMetadata, scale: float) -> torch.Tensor:
        self._write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.dtype not in DTYPES or (k_cache.dtype != q.dtype and k_cache.dtype not in FP8_FORMATS):
            raise TypeError(f"cpu_paged attention: float32 or bfloat16 q and a cache of q's dtype or fp8, got "
                            f"{q.dtype}, {k_cache.dtype}")
        if k_cache.dtype in FP8_FORMATS and (meta.amx_num_rows or meta.amx_num_decodes):
            raise TypeError("cpu_paged attention: the AMX kernels read bf16 caches only, not fp8")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("cpu_paged attention: the layer's cache views must be contiguous")
        q = q.contiguous()
        num_heads, head_dim = q.shape[1], q.shape[2]
        out = q.new_empty(meta.num_tokens, num_heads * head_dim)
        if meta.num_rows:
            self._native(q, k_cache, v_cache, out, meta, scale)
        if meta.torch_groups:
            attend_groups(q, k_cache, v_cache, out, meta.torch_groups, meta.block_size, scale)
        if meta.amx_num_rows:
            self.amx(q, k_cache, v_cache, out, meta.amx_rows, meta.amx_max_blocks, meta.amx_num_rows,
                     meta.amx_padded_keys, meta.block_size, scale)
        if meta.amx_num_decodes:
            self.amx.decode(q, k_cache, v_cache, out, meta.amx_decodes, meta.amx_decode_blocks,
                            meta.amx_num_decodes, meta.amx_decode_groups, meta.block_size, scale)
        return out

    def _write_kv(self, k, v, k_cache, v_cache, slots: torch.Tensor) -> None:
        """:func:`write_kv` as one C loop of row copies where the rows allow it (a token's heads contiguous,
        the caches contiguous, the same dtype), else torch's index_copy_."""
        row = k_cache.shape[1] * k_cache.shape[2]
        if (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype or k.dtype != v.dtype or k.dim() != 3
                or k.stride()[1:] != (k.shape[2], 1) or v.stride()[1:] != (v.shape[2], 1)
                or k.shape[1] * k.shape[2] != row or not (k_cache.is_contiguous() and v_cache.is_contiguous())
                or slots.dtype != torch.int64 or not slots.is_contiguous()):
            write_kv(k, v, k_cache, v_cache, slots)
            return
        if self.write_fn(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                         v_cache.data_ptr(), slots.data_ptr(), k.shape[0], row, k.element_size()):
            raise RuntimeError("cpu_paged: a negative KV cache slot")

    def _native(self, q, k_cache, v_cache, out, meta: CpuPagedMetadata, scale: float) -> None:
        start, length, seq, tables = meta.rows
        rc = self.fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), start.data_ptr(),
                     length.data_ptr(), seq.data_ptr(), tables.data_ptr(), meta.max_blocks, meta.num_rows,
                     q.shape[1], k_cache.shape[1], q.shape[2], meta.block_size, meta.window, DTYPES[q.dtype],
                     scale, torch.get_num_threads(), self.fast_min_query or 0, meta.num_shared,
                     *(x.data_ptr() for x in meta.shared), FP8_FORMATS.get(k_cache.dtype, 0))
        if rc:
            raise RuntimeError(f"cpu_paged attention kernel failed (code {rc}: 1 bad shape, 2 out of memory)")


def _queue_rows(upload: StepUpload, prefix: str, rows: StepLayout) -> int:
    """Queue ``rows``' query starts, lengths, sequence lengths and block tables (each padded to the longest)
    as ``<prefix>_start`` / ``_len`` / ``_seq`` / ``_tables``; returns the tables' width in blocks."""
    max_blocks = max((-(-n // rows.block_size) for n in rows.seq_lens), default=1)
    upload.add(f"{prefix}_start", rows.query_starts)
    upload.add(f"{prefix}_len", rows.query_lens)
    upload.add(f"{prefix}_seq", rows.seq_lens)
    tables: list[int] = []
    for table in rows.block_tables:
        row = table[:max_blocks]
        tables += row + [0] * (max_blocks - len(row))
    upload.add(f"{prefix}_tables", tables)
    return max_blocks


def _queue_groups(upload: StepUpload, prefix: str, groups: list[tuple[list[int], int]]) -> None:
    """Queue groups of rows sharing cached keys (:func:`shared_prefix_groups`) as ``<prefix>_off`` (member
    offsets, one more than the groups), ``_rows`` (members) and ``_len`` (shared keys per group)."""
    offsets, members, lengths = [0], [], []
    for rows, length in groups:
        members += rows
        offsets.append(len(members))
        lengths.append(length)
    upload.add(f"{prefix}_off", offsets)
    upload.add(f"{prefix}_rows", members or [0])
    upload.add(f"{prefix}_len", lengths or [0])


def _window_view(meta: CpuPagedMetadata, torch_meta: AttentionMetadata | None, layout: StepLayout,
                 window: int | None) -> CpuPagedMetadata:
    """``meta`` for the layers attending with ``window``: the same uploaded rows, that window, its torch groups."""
    view = copy.copy(meta)
    view.layer_views = None
    view.window = window or 0
    if torch_meta is not None:
        view.torch_groups = torch_meta.for_layer(layout.layer_windows.index(window)).groups
    return view


def _split_rows(layout: StepLayout, native_max_query: int | None) -> tuple[StepLayout, StepLayout]:
    """The step's rows for the native kernel, and the long prompt chunks for the torch groups (same flat batch)."""
    return _partition(layout, lambda i: native_max_query is not None and layout.query_lens[i] > native_max_query)


def _partition(layout: StepLayout, moved) -> tuple[StepLayout, StepLayout]:
    """``(rows kept, rows for which moved(index) is true)``, each a layout over the same flat batch."""
    parts = tuple(StepLayout([], [], [], [], layout.num_tokens, layout.block_size, sliding_window=layout.sliding_window,
                             layer_windows=layout.layer_windows) for _ in range(2))
    for i, row in enumerate(zip(layout.query_starts, layout.query_lens, layout.seq_lens, layout.block_tables)):
        part = parts[bool(moved(i))]
        for values, value in zip((part.query_starts, part.query_lens, part.seq_lens, part.block_tables), row):
            values.append(value)
    return parts


def shared_prefix_groups(layout: StepLayout) -> list[tuple[list[int], int]]:
    """Decode rows whose block tables start with the same blocks (prefix-cache hits on one prompt header):
    ``[(rows, shared_keys)]``, each group at least 2 rows sharing at least ``SHARED_MIN_KEYS`` keys of whole
    blocks that every member's query sees; none with a sliding window. The tables are sorted and cut where
    two neighbours share fewer keys, so rows under a common header but with different few-shot prefixes form
    one group per prefix."""
    if layout.smallest_window:
        return []
    bs = layout.block_size
    min_blocks = -(-SHARED_MIN_KEYS // bs)
    rows = sorted((i for i, (q_len, seq_len) in enumerate(zip(layout.query_lens, layout.seq_lens))
                   if q_len == 1 and seq_len - 1 >= SHARED_MIN_KEYS), key=lambda i: layout.block_tables[i])
    groups, run, common = [], [], 0
    for i in rows:
        if run:
            prev, table = layout.block_tables[run[-1]], layout.block_tables[i]
            limit = min(common, (layout.seq_lens[i] - 1) // bs)  # whole blocks before every member's own token
            same = 0
            while same < limit and table[same] == prev[same]:
                same += 1
            if same >= min_blocks:
                run.append(i)
                common = same
                continue
            if len(run) > 1:
                groups.append((sorted(run), common * bs))
        run, common = [i], (layout.seq_lens[i] - 1) // bs
    if len(run) > 1:
        groups.append((sorted(run), common * bs))
    return groups


def bf16_chunks_to_sdpa() -> tuple[bool, str]:
    """``(send long bf16 prompt chunks to torch's SDPA, why)``, from the capability and the setting."""
    return capability_switch(BF16_SDPA_ENV, BF16_SDPA_CAPABILITIES,
                             f"bf16 prompt chunks of more than {BF16_SDPA_MIN_QUERY} tokens on torch's SDPA",
                             "bf16 prompt chunks on the fast kernel")


def make_cpu_paged_backend(device, head_dim: int, dtype: torch.dtype | None = None, num_heads: int = 0,
                           num_kv_heads: int = 0, block_size: int = 0,
                           cache_dtype: torch.dtype | None = None) -> CpuPagedBackend:
    """The backend with its capability defaults (for ``dtype``: :func:`bf16_chunks_to_sdpa`; with the heads and
    block size given, whether decodes take the AMX kernel), or ``RuntimeError`` saying why it cannot run here.
    ``cache_dtype`` (default ``dtype``): an fp8 cache keeps every row off the AMX kernels, which read bf16 caches
    only (the native kernel widens fp8 tiles itself; ``chunk_route`` says so)."""
    reason = cpu_paged_unavailable_reason(device, head_dim)
    if reason:
        raise RuntimeError(reason)
    backend = CpuPagedBackend(native_library())
    fp8 = cache_dtype in FP8_FORMATS
    if dtype == torch.bfloat16 and backend.fast_min_query and backend.native_max_query is None:
        use_amx, amx_why = amx_chunk_route(head_dim)
        if use_amx and not fp8:
            backend.amx, backend.chunk_route = AmxPromptAttention(), amx_why
            backend.native_max_query = AMX_MIN_QUERY
            backend.amx_decode = amx_decode_route(head_dim, num_heads, num_kv_heads, block_size)
            return backend
        use, backend.chunk_route = bf16_chunks_to_sdpa()
        if use_amx:  # the AMX kernels read bf16 caches only: an fp8 cache takes the native kernel (and SDPA)
            backend.chunk_route = f"fp8 KV cache, so not the AMX kernels (bf16 caches only); {backend.chunk_route}"
        if use:
            backend.native_max_query = BF16_SDPA_MIN_QUERY
    return backend
