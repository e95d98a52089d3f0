"""The long endpoint checks (`heavy`): the budgets as the server counts them under 429s (a shortened window),
greedy texts equal with and without faults, and through scripts/endpoint_bench.py's own functions the
200-row job under 30% 429 + Retry-After 1 (no error row, the budgets held as the server saw them; the time
against the ideal is printed, not asserted) and the same model through engine.backend vllm and through the
endpoint (float32 greedy texts equal on at least 14 of 16 rows, both reports priced). The whole job stopped
by the cap and rerun is test_endpoint_job.py (heavy too)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import pytest

from tests.components import REPO_ROOT
from tests.endpoint.proxy import FaultProxy, max_in_window
from tests.endpoint.test_endpoint_vllm import _engine, _run
from tests.vllm_backend.vllm_python import vllm_python_or_skip

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(1800)]


def _bench():
    spec = importlib.util.spec_from_file_location("endpoint_bench", REPO_ROOT / "scripts" / "endpoint_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_200_rows_under_30_percent_429_hold_the_budgets(local_ray, vllm_endpoint, tmp_path):
    args = argparse.Namespace(rows=200, rpm=90.0, tpm=20000.0, rate_429=0.3, max_tokens=8, concurrency=32)
    result = _bench().budget(vllm_endpoint.url, tmp_path, args)
    print(json.dumps(result, indent=2))
    assert result["ok"] and result["rows"] == 200 and result["error_rows"] == 0
    assert result["forwarded"] == 200 and result["answered_429"] > 0
    assert result["max_requests_in_60s"] <= 90 and result["max_tokens_in_60s"] <= 20000


def test_the_endpoint_and_engine_backend_vllm_agree(local_ray, vllm_endpoint, tmp_path):
    result = _bench().compare(vllm_endpoint.url, tmp_path, vllm_python_or_skip())
    print(json.dumps(result, indent=2, default=str))
    assert result["rows"] == 16 and result["equal_texts"] >= 14
    local, remote = result["cost"]["vllm-out"], result["cost"]["endpoint-out"]
    assert local["usd_per_m_total"] is not None and local["token_priced"] is None
    assert remote["token_priced"]["usd_per_m_input"] == 0.15 and remote["token_priced"]["total_usd"] > 0


def test_budgets_hold_at_the_server_under_429s(vllm_endpoint):
    """The budgets over a 4 s window (a minute's rule, shortened): 10 requests and 600 tokens in any 4 s at the
    server, so 30 rows need three windows or more; the 429s the proxy answers are given back."""
    with FaultProxy(vllm_endpoint.url, seed=11, rate_429=0.3, retry_after="0.5") as proxy:
        engine = _engine(proxy.url, max_concurrency=8, max_retries=20, requests_per_minute=10,
                         tokens_per_minute=600, window_s=4.0)
        start = time.monotonic()
        outputs = _run(engine, 30)
        forwarded = proxy.forwarded()
    assert len(forwarded) == 30 and not [o for o in outputs.values() if o.error]
    assert max_in_window(forwarded, 4.0) <= 10
    assert max_in_window(forwarded, 4.0, tokens=True) <= 600
    assert max(r.time for r in forwarded) - start >= 8.0  # the budget made rows wait for later windows
    assert sum(r.outcome == "429" for r in proxy.records) > 0


def test_greedy_texts_equal_without_and_with_faults(vllm_endpoint):
    clean = _run(_engine(vllm_endpoint.url, max_concurrency=4), 6)
    with FaultProxy(vllm_endpoint.url, seed=3, rate_429=0.3, retry_after="0", rate_drop=0.2) as proxy:
        faulty = _run(_engine(proxy.url, max_concurrency=4, max_retries=30), 6)
    assert {k: o.text for k, o in clean.items()} == {k: o.text for k, o in faulty.items()}
