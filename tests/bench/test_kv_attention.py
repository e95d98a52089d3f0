"""`jobrunner bench --kv-attention`: decode attention per CPU route and KV-cache dtype (was
scripts/kv_cache_bench.py). The table's cases, its byte counts, and that the routes it times compute the same
attention over the same caches."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from jobrunner.attention.kv_quant import cache_dtype, row_width
from jobrunner.bench.kv_attention import KVCase, KVShape
from jobrunner.cli import main


def test_kv_attention_times_every_route_and_cache_dtype_per_row_count():
    result = CliRunner().invoke(main, ["bench", "--kv-attention", "48", "--batch-sizes", "2,3", "--json"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("decode attention per layer: bfloat16 model, 9 heads / 3 kv heads x 64, 24 layers")
    records = json.loads(lines[-1])["kv_attention"]
    assert len(lines) == 1 + len(records) + 1  # header, one line per record, the JSON
    cases = [("cpu_paged+amx", "auto"), *((r, kv) for r in ("cpu_paged", "torch")
                                          for kv in ("auto", "fp8_e4m3", "fp8_e5m2"))]
    assert [(r["rows"], r["route"], r["kv_cache_dtype"]) for r in records] == [
        (rows, route, kv) for rows in (2, 3) for route, kv in cases]
    amx = KVCase("cpu_paged+amx", "auto", 1, 16, torch.bfloat16, KVShape(layers=1)).skipped is None
    for r in records:
        if r["route"] == "cpu_paged+amx" and not amx:
            assert r["skipped"] == "no AMX decode route on this CPU"
            continue
        dtype = cache_dtype(r["kv_cache_dtype"], torch.bfloat16)
        want = 2 * r["rows"] * 48 * 3 * row_width(64, dtype) * dtype.itemsize
        assert r["kv_mib_read"] == round(want / 2**20, 1) and r["us"] > 0
        assert r["gib_per_s"] == pytest.approx(want / (r["us"] / 1e6) / 2**30, rel=0.02, abs=0.01)


def test_kv_attention_refuses_float16():
    result = CliRunner().invoke(main, ["bench", "--kv-attention", "48", "--dtype", "float16"])
    assert result.exit_code == 2 and "--dtype bfloat16 or float32" in result.output


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_the_timed_routes_compute_the_same_attention(kv, model_dtype):
    shape = KVShape(layers=1)
    routes = ["torch", "cpu_paged", "cpu_paged+amx"] if kv == "auto" else ["torch", "cpu_paged"]
    outputs = {}
    for route in routes:
        case = KVCase(route, kv, 5, 70, model_dtype, shape)
        if case.skipped:
            continue
        cache = case.caches[0]
        outputs[route] = case.backend.forward(case.q, case.k, case.v, cache[0], cache[1], case.meta,
                                              case.scale).float()
    want = outputs.pop("torch")
    assert want.shape == (5, 9 * 64)
    tolerance = 3e-2 if model_dtype == torch.bfloat16 else 1e-4
    for route, got in outputs.items():
        assert (got.reshape(want.shape) - want).abs().max().item() < tolerance, route
