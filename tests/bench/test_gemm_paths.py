"""`jobrunner bench --gemm-paths`: every GEMM path per SmolLM2 layer shape, the same numbers as F.linear (float32;
bfloat16 where oneDNN has bf16 kernels for this CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from jobrunner.cli import main
from jobrunner.models.onednn_linear import onednn_bf16_supported
from jobrunner.models.packed_linear import packed_library
from tests.components import require_library


def test_gemm_paths_times_every_path_per_shape_and_row_count():
    require_library(packed_library())
    result = CliRunner().invoke(main, ["bench", "--gemm-paths", "--batch-sizes", "1,7", "--json"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("float32: torch ") and "engine: " in lines[0]
    records = json.loads(lines[-1])["gemm_paths"]
    assert [(r["shape"], r["rows"]) for r in records] == [
        (shape, rows) for shape in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head") for rows in (1, 7)]
    for record in records:
        paths = record["paths"]
        assert {"F.linear", "packed"} <= set(paths)
        assert paths["F.linear"]["speedup"] == 1.0 and paths["F.linear"]["rel_error"] == 0.0
        assert all(p["us"] > 0 and p["rel_error"] < 1e-5 for p in paths.values())
    assert len(lines) == 1 + len(records) + 1  # header, one line per record, the JSON


@pytest.mark.skipif(not onednn_bf16_supported(), reason="this CPU has no bf16 hardware for oneDNN")
def test_gemm_paths_in_bf16_time_f_linear_and_the_reordered_weight():
    result = CliRunner().invoke(main, ["bench", "--gemm-paths", "--dtype", "bfloat16", "--batch-sizes", "3",
                                       "--json"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("bfloat16: torch ") and "engine: " in lines[0]
    records = json.loads(lines[-1])["gemm_paths"]
    assert len(records) == 5 and all(r["dtype"] == "bfloat16" for r in records)
    for record in records:
        paths = record["paths"]
        # the packed float32 kernel has no bf16 build; our AMX GEMM runs on AMX CPUs only
        amx = torch.backends.cpu.get_cpu_capability().lower() == "avx512" and torch.cpu._is_amx_tile_supported()
        assert set(paths) == {"F.linear", "onednn"} | ({"amx"} if amx else set())
        assert all(p["us"] > 0 and p["rel_error"] < 1e-2 for p in paths.values())
