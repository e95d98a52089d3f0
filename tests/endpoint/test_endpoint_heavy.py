"""The long endpoint checks (`heavy`), through scripts/endpoint_bench.py's own functions: the 200-row job under
30% 429 + Retry-After 1 (no error row, the budgets held as the server saw them; the time against the ideal is
printed, not asserted), and the same model through engine.backend vllm and through the endpoint (float32 greedy
texts equal on at least 14 of 16 rows, both reports priced)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from tests.components import REPO_ROOT
from tests.vllm_backend.vllm_python import vllm_python_or_skip

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1800)]


def _bench():
    spec = importlib.util.spec_from_file_location("endpoint_bench", REPO_ROOT / "scripts" / "endpoint_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_200_rows_under_30_percent_429_hold_the_budgets(local_ray, vllm_endpoint, tmp_path):
    args = argparse.Namespace(rows=200, rpm=180.0, tpm=20000.0, rate_429=0.3, max_tokens=16)
    result = _bench().budget(vllm_endpoint.url, tmp_path, args)
    print(json.dumps(result, indent=2))
    assert result["ok"] and result["rows"] == 200 and result["error_rows"] == 0
    assert result["forwarded"] == 200 and result["answered_429"] > 0
    assert result["max_requests_in_60s"] <= 180 and result["max_tokens_in_60s"] <= 20000


def test_the_endpoint_and_engine_backend_vllm_agree(local_ray, vllm_endpoint, tmp_path):
    result = _bench().compare(vllm_endpoint.url, tmp_path, vllm_python_or_skip())
    print(json.dumps(result, indent=2, default=str))
    assert result["rows"] == 16 and result["equal_texts"] >= 14
    local, remote = result["cost"]["vllm-out"], result["cost"]["endpoint-out"]
    assert local["usd_per_m_total"] is not None and local["token_priced"] is None
    assert remote["token_priced"]["usd_per_m_input"] == 0.15 and remote["token_priced"]["total_usd"] > 0
