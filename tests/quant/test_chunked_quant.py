"""The quantizers work on chunks of rows (bounded float32 temporaries: a streamed quantized load's peak stays
near its layer) and give exactly what one pass over the whole weight gives; the CPU int4 packing by row blocks
is the kernel's own packing of the whole weight."""

from __future__ import annotations

import pytest
import torch

from jobrunner.quant import primitives
from jobrunner.quant.kernels import pack_int4


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(primitives, "CHUNK_ELEMENTS", 64 * 256)  # many chunks even for a small weight


def test_row_chunks_cover_every_row_in_64_row_blocks():
    chunks = primitives.row_chunks(1000, 1 << 14)
    assert [(c.start, c.stop) for c in chunks[:2]] == [(0, 64), (64, 128)] and chunks[-1].stop == 1000
    assert primitives.row_chunks(10, 8) == [slice(0, 10)]


def test_chunked_quantizers_equal_one_pass(small_chunks):
    torch.manual_seed(0)
    w = torch.randn(1000, 256, dtype=torch.bfloat16)
    q, sz = primitives.quantize_int4_groupwise(w, 32)
    codes, scales = primitives.quantize_int8_per_channel(w)
    primitives.CHUNK_ELEMENTS = 1 << 40  # one chunk
    q_whole, sz_whole = primitives.quantize_int4_groupwise(w, 32)
    assert q.dtype == torch.int32 and torch.equal(q, q_whole) and torch.equal(sz, sz_whole)
    assert torch.equal(primitives.quantize_int4_groupwise(w, 32, torch.uint8)[0], q_whole.to(torch.uint8))
    codes_whole, scales_whole = primitives.quantize_int8_per_channel(w)
    assert torch.equal(codes, codes_whole) and torch.equal(scales, scales_whole)


@pytest.mark.parametrize("rows", [176, 976, 1008])  # whole 16-row groups, as int4 needs on CPU
def test_cpu_packing_by_row_blocks_is_the_kernels_packing(small_chunks, rows):
    q = torch.randint(0, 16, (rows, 256), dtype=torch.int32)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    assert len(primitives.row_chunks(rows, 256)) > 1 and torch.equal(pack_int4(q.to(torch.uint8)), whole)
