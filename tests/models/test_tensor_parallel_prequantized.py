"""Pre-quantized checkpoints (GPTQ / AWQ / compressed-tensors FP8, made by the real tools: tests/quant/fixtures)
loaded sharded, in one process: each rank's layers, dequantized, put together are the whole layer's dequantized
weight exactly (column-parallel q|k|v and gate|up by output rows, row-parallel o_proj and down_proj by input
columns); a rank's share of a group runs at a smaller group with the same numbers; what cannot be cut is refused
naming the numbers (world 2 equals world 1 through the engine: tests/models/test_tensor_parallel_parity.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from jobrunner.models.loader import build_model, load_weights
from jobrunner.models.parallel import TensorParallel
from jobrunner.models.prequantized import PrequantizedLoad
from jobrunner.models.weights import Checkpoint, load_config
from jobrunner.quant.prequantized import CheckpointQuant, read_checkpoint_quant
from jobrunner.quant.prequantized.shard import slice_columns, slice_rows

FIXTURES = Path(__file__).resolve().parents[1] / "quant" / "fixtures"
NAMES = ["gptq-sym-g128", "gptq-asym-channel", "awq-g128", "awq-asym-g128", "autoawq-g128", "fp8-channel",
         "fp8-tensor"]
CPU = torch.device("cpu")
Q, KV, INTER = 128, 64, 256  # the fixtures' q rows (4 heads of 32), k / v rows (2 KV heads), intermediate size


def load(name: str, rank: int | None, world: int = 2) -> torch.nn.Module:
    """The fixture as our float32 model (whole, or rank ``rank``'s shard), its layers built from its tensors."""
    directory = FIXTURES / name
    config = load_config(directory)
    tp = None if rank is None else TensorParallel(rank, world)
    model = build_model(config, torch.float32, CPU, materialize=False, tensor_parallel=tp)
    checkpoint = Checkpoint(directory)
    transform = PrequantizedLoad(model, read_checkpoint_quant(config.quantization_config), checkpoint.names(), CPU)
    load_weights(model, checkpoint, device=CPU, transform=transform)
    return model


def weights(model: torch.nn.Module, layer: int) -> dict[str, torch.Tensor]:
    return {leaf: model.get_submodule(f"layers.{layer}.{leaf}").dequantized_weight(torch.float32)
            for leaf in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}


@pytest.mark.parametrize("name", NAMES)
def test_rank_shards_put_together_are_the_whole_dequantized_weight(name):
    whole_model = load(name, None)
    ranks = [load(name, r) for r in range(2)]
    for layer in range(2):
        whole, parts = weights(whole_model, layer), [weights(m, layer) for m in ranks]
        qkv = [p["self_attn.qkv_proj"].split([Q // 2, KV // 2, KV // 2]) for p in parts]
        for i, rows in enumerate(whole["self_attn.qkv_proj"].split([Q, KV, KV])):
            assert torch.equal(torch.cat([p[i] for p in qkv]), rows), (name, layer, "qkv", i)
        gate_up = [p["mlp.gate_up_proj"].chunk(2) for p in parts]
        for half, rows in enumerate(whole["mlp.gate_up_proj"].chunk(2)):
            assert torch.equal(torch.cat([g[half] for g in gate_up]), rows), (name, layer, "gate_up", half)
        for leaf in ("self_attn.o_proj", "mlp.down_proj"):
            assert parts[0][leaf].shape == (128, whole[leaf].shape[1] // 2)
            assert torch.equal(torch.cat([p[leaf] for p in parts], dim=1), whole[leaf]), (name, layer, leaf)


def test_a_rank_share_of_a_group_runs_at_a_smaller_group():
    """gptq-sym-g128 at world 2: o_proj's 64 input rows per rank are half a group of 128 (run at group 64, the
    group's scale and zero repeated); down_proj's 128 rows per rank are one whole group each."""
    whole, rank = load("gptq-sym-g128", None), load("gptq-sym-g128", 1)
    assert whole.get_submodule("layers.0.self_attn.o_proj").group_size == 128
    assert rank.get_submodule("layers.0.self_attn.o_proj").group_size == 64
    assert rank.get_submodule("layers.0.mlp.down_proj").group_size == 128
    assert rank.get_submodule("layers.0.self_attn.qkv_proj").out_features == (Q + 2 * KV) // 2


GPTQ_G128 = CheckpointQuant("gptq", "int4", 4, group_size=128)
AWQ_G128 = CheckpointQuant("awq", "int4", 4, group_size=128)


def test_group_rows_are_cut_or_regrouped():
    scales = torch.arange(4 * 3, dtype=torch.float16).reshape(4, 3)  # 4 groups of 128 rows (K 512), N 3
    assert torch.equal(slice_rows(GPTQ_G128, "scales", scales, 256, 256, "x"), scales[2:])
    assert torch.equal(slice_rows(GPTQ_G128, "scales", scales, 192, 64, "x"), scales[1:2])  # group 1's 2nd half
    assert torch.equal(slice_rows(GPTQ_G128, "scales", scales, 96, 96, "x"), scales[[0, 1, 1]])  # at group 32
    g_idx = torch.arange(512, dtype=torch.int32) // 128
    assert torch.equal(slice_rows(GPTQ_G128, "g_idx", g_idx, 96, 96, "x"), torch.tensor([0] * 32 + [1] * 32
                                                                                            + [2] * 32).int())
    qweight = torch.arange(64 * 3, dtype=torch.int32).reshape(64, 3)  # GPTQ: 8 rows a word
    assert torch.equal(slice_rows(GPTQ_G128, "qweight", qweight, 256, 256, "x"), qweight[32:])
    awq = torch.arange(512 * 2, dtype=torch.int32).reshape(512, 2)  # AWQ: rows unpacked, 8 columns a word
    assert torch.equal(slice_rows(AWQ_G128, "qweight", awq, 256, 256, "x"), awq[256:])
    assert torch.equal(slice_columns(AWQ_G128, "qweight", awq, 8, 8, "x"), awq[:, 1:])
    assert torch.equal(slice_columns(GPTQ_G128, "qweight", qweight, 1, 2, "x"), qweight[:, 1:])


def test_what_does_not_fall_on_a_boundary_is_refused_naming_the_numbers():
    scales = torch.zeros(14, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="gptq group_size 128: layers.0.mlp.down_proj's input rows per rank 48 are "
                                         "not a multiple of 128 nor of a smaller int4 group"):
        slice_rows(GPTQ_G128, "scales", scales, 48, 48, "layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"gptq: layers.0.mlp.down_proj's input rows per rank 36 \(from 36\) are not "
                                         r"a multiple of 8 \(qweight packs 8 rows per int32\)"):
        slice_rows(GPTQ_G128, "qweight", torch.zeros(9, 16, dtype=torch.int32), 36, 36, "layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match=r"awq: layers.0.self_attn.qkv_proj \(k\)'s output columns per rank 20 "
                                         r"\(from 20\) are not a multiple of 8 \(qzeros packs 8 columns per int32\)"):
        slice_columns(AWQ_G128, "qzeros", torch.zeros(1, 5, dtype=torch.int32), 20, 20,
                      "layers.0.self_attn.qkv_proj (k)")
    act_order = torch.tensor([1, 0, 1, 0] * 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="gptq act-order .*layers.0.self_attn.o_proj cannot be split"):
        slice_rows(GPTQ_G128, "g_idx", act_order, 0, 128, "layers.0.self_attn.o_proj")


def test_fused_checkpoint_tensors_are_refused_and_a_row_parallel_bias_is_rank_0s():
    """A pre-quantized q|k|v stored fused (Phi-3 style, part None) is not cut; o_proj's bias is added once."""
    from jobrunner.models.parallel.shard import slicer_for

    config = load_config(FIXTURES / "gptq-sym-g128")
    model = build_model(config, torch.float32, CPU, materialize=False, tensor_parallel=TensorParallel(1, 2))
    slicer = slicer_for(model, packed=GPTQ_G128, packed_modules={"layers.0.self_attn.qkv_proj",
                                                                  "layers.0.self_attn.o_proj"})
    with pytest.raises(ValueError, match=r"pre-quantized layers.0.self_attn.qkv_proj \(gptq\): a fused checkpoint "
                                         "tensor cannot be split over tensor_parallel_size 2"):
        slicer.slice("layers.0.self_attn.qkv_proj.qweight", None, torch.zeros(16, 256, dtype=torch.int32))
    part, bias = slicer.slice("layers.0.self_attn.o_proj.bias", None, torch.ones(128))
    assert part is None and torch.equal(bias, torch.zeros(128))
    part, scales = slicer.slice("layers.0.self_attn.qkv_proj.scales", 2, torch.arange(64.0).reshape(1, 64))
    assert part == 2 and torch.equal(scales, torch.arange(32.0, 64.0).reshape(1, 32))  # rank 1's v columns
