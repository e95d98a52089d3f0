"""A tensor-parallel rank's slice of one pre-quantized checkpoint tensor (GPTQ / AWQ / compressed-tensors FP8).

Pure tensor ops on one tensor as it streams (the loader's ``RankSlicer`` calls them with the rank's range), so a
rank never holds a whole packed layer. A column-parallel layer (q|k|v, gate|up) takes its output columns
``[start, start + count)``, a row-parallel one (o_proj, down_proj) its input rows; every tensor of the format is
cut consistently, and each shard keeps its own scales (the whole layer's, for its rows / columns):

=========  ==========================  ======================================  ===================================
format     tensor                      output columns (column-parallel)        input rows (row-parallel)
=========  ==========================  ======================================  ===================================
GPTQ       ``qweight`` [K/8, N]        columns                                 words of 8 rows (``start``, ``count``
                                                                               multiples of 8)
GPTQ       ``qzeros`` [G, N/8]         words of 8 columns (multiples of 8)     the rank's groups
GPTQ/AWQ   ``scales`` [G, N]           columns                                 the rank's groups
GPTQ       ``g_idx`` [K]               whole                                   ``k // group`` of the shard
AWQ        ``qweight`` [K, N/8]        words of 8 columns (multiples of 8)     rows
AWQ        ``qzeros`` [G, N/8]         words of 8 columns (multiples of 8)     the rank's groups
FP8        ``weight`` [N, K]           rows of ``weight``                      columns of ``weight``
FP8        ``weight_scale``            per channel: its rows; per tensor:      whole (an output row's scale
                                       whole (replicated)                      covers all its inputs)
=========  ==========================  ======================================  ===================================

The rank's groups: when ``count`` is a multiple of the group size the groups are narrowed as they are. When it
is not (a rank's rows are part of a group, e.g. o_proj's 64 rows per rank of a group of 128), each group's scale
and zero are repeated to the largest int4 kernel group ``g'`` (32, 64, 128, 256) that divides both the group and
``count``, then narrowed: the dequantized weights are the same numbers, run at group ``g'``. A per-channel
checkpoint (one group of K) keeps its one group. Anything else is refused naming the numbers. Act-order (a
``g_idx`` that is not ``k // group``) is refused.
"""

from __future__ import annotations

import torch

from jobrunner.quant.prequantized.formats import INT4_GROUPS, CheckpointQuant
from jobrunner.quant.prequantized.repack import check_g_idx

PACK = 8  # 4-bit codes per int32 word


def slice_columns(quant: CheckpointQuant, kind: str, tensor: torch.Tensor, start: int, count: int,
                  where: str) -> torch.Tensor:
    """The output columns ``[start, start + count)`` of one checkpoint tensor ``kind`` of a column-parallel
    layer (``where`` names it in a refusal)."""
    if kind in ("bias", "weight"):  # a bias [N]; FP8's weight [N, K]
        return tensor.narrow(0, start, count)
    if kind == "weight_scale":
        return tensor if tensor.numel() == 1 else tensor.narrow(0, start, count)  # per tensor: replicated
    if kind in ("scales",) or (kind == "qweight" and quant.method == "gptq"):
        return tensor.narrow(1, start, count)
    if kind in ("qzeros", "qweight"):  # packed 8 columns to a word: GPTQ's qzeros, AWQ's both
        _check_multiple(quant, f"{where}'s output columns per rank", start, count, PACK,
                        f"{kind} packs {PACK} columns per int32")
        return tensor.narrow(1, start // PACK, count // PACK)
    if kind == "g_idx":
        return tensor
    return _other(kind, tensor, where)


def slice_rows(quant: CheckpointQuant, kind: str, tensor: torch.Tensor, start: int, count: int,
               where: str) -> torch.Tensor:
    """The input rows ``[start, start + count)`` of one checkpoint tensor ``kind`` of a row-parallel layer
    (its bias is handled by the caller: rank 0's)."""
    if kind == "weight":  # FP8 [N, K]
        return tensor.narrow(1, start, count)
    if kind == "weight_scale":
        return tensor
    if kind == "qweight":
        if quant.method == "awq":  # [K, N/8]: rows unpacked
            return tensor.narrow(0, start, count)
        _check_multiple(quant, f"{where}'s input rows per rank", start, count, PACK,
                        f"qweight packs {PACK} rows per int32")
        return tensor.narrow(0, start // PACK, count // PACK)
    if kind in ("scales", "qzeros"):
        return _group_rows(quant, tensor, start, count, where)
    if kind == "g_idx":  # the whole layer's must be plain; the shard's is then plain at its own group
        whole_group = quant.group_size or tensor.numel()
        try:
            check_g_idx(tensor, whole_group)
        except ValueError:
            raise ValueError(f"{quant.method} act-order (desc_act: a g_idx that is not k // group_size): {where} "
                             "cannot be split over tensor-parallel ranks") from None
        local = count if quant.group_size is None else row_group(quant, count, where)
        return torch.arange(count, dtype=tensor.dtype) // local
    return _other(kind, tensor, where)


def row_group(quant: CheckpointQuant, count: int, where: str) -> int:
    """The group a row-parallel shard of ``count`` rows runs at: the checkpoint's when ``count`` is a multiple
    of it, else the largest int4 kernel group dividing both; ValueError naming the numbers when none does."""
    group = quant.group_size
    if group is None or count % group == 0:
        return group or count
    for size in sorted(INT4_GROUPS, reverse=True):
        if group % size == 0 and count % size == 0:
            return size
    raise ValueError(f"{quant.method} group_size {group}: {where}'s input rows per rank {count} are not a multiple "
                     f"of {group} nor of a smaller int4 group dividing it ({', '.join(map(str, INT4_GROUPS))})")


def _group_rows(quant: CheckpointQuant, tensor: torch.Tensor, start: int, count: int, where: str) -> torch.Tensor:
    """The rows of per-group ``scales`` / ``qzeros`` [G, .] that cover input rows ``[start, start + count)``,
    at the shard's group (:func:`row_group`)."""
    group = quant.group_size
    if group is None:  # one group per output channel: every rank keeps it
        return tensor
    local = row_group(quant, count, where)
    first, last = start // group, (start + count - 1) // group
    covering = tensor.narrow(0, first, last - first + 1)
    if local != group:
        covering = covering.repeat_interleave(group // local, dim=0)
    return covering.narrow(0, (start - first * group) // local, count // local)


def _check_multiple(quant: CheckpointQuant, what: str, start: int, count: int, multiple: int, why: str) -> None:
    if start % multiple or count % multiple:
        raise ValueError(f"{quant.method}: {what} {count} (from {start}) are not a multiple of {multiple} ({why})")


def _other(kind: str, tensor: torch.Tensor, where: str) -> torch.Tensor:
    """A tensor this module does not cut: a scalar (e.g. a per-tensor scale) is the same on every rank."""
    if tensor.numel() <= 1:
        return tensor
    raise ValueError(f"pre-quantized {where}: checkpoint tensor kind {kind!r} cannot be split over "
                     "tensor-parallel ranks")
