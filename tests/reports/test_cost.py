"""The cost formula with exact numbers, and None (never NaN/inf) where a figure is undefined."""

from __future__ import annotations

import pytest

from jobrunner.reports.cost import cost_figures, goodput_cost, per_million, prefill_share


def test_cost_formula_exact() -> None:
    # 2 workers x 1800 s at $3.60/h = $3.60; engine time 25% prefill.
    cost = cost_figures(3600.0, 3.6, input_tokens=2_000_000, output_tokens=1_000_000, prefill_s=100.0,
                        decode_s=300.0)
    assert cost["total_usd"] == pytest.approx(3.6)
    assert cost["prefill_share"] == pytest.approx(0.25)
    assert cost["usd_per_m_total"] == pytest.approx(3.6 / 3)
    assert cost["usd_per_m_input"] == pytest.approx(0.9 / 2)
    assert cost["usd_per_m_output"] == pytest.approx(2.7)
    assert cost["notes"] == []


def test_no_price_gives_none_and_a_note() -> None:
    cost = cost_figures(100.0, None, 10, 10, 1.0, 1.0)
    assert cost["total_usd"] is None and cost["usd_per_m_total"] is None
    assert any("no price" in note for note in cost["notes"])


def test_zero_output_tokens_no_division_by_zero() -> None:
    cost = cost_figures(100.0, 1.0, 1000, 0, 1.0, 0.0)
    assert cost["usd_per_m_output"] is None
    assert cost["usd_per_m_input"] == pytest.approx(100 / 3600 / 1000 * 1e6)
    assert any("zero output tokens" in note for note in cost["notes"])


def test_nothing_at_all() -> None:
    cost = cost_figures(None, 1.0, 0, 0, 0.0, 0.0)
    keys = ("total_usd", "usd_per_m_input", "usd_per_m_output", "usd_per_m_total")
    assert all(cost[k] is None for k in keys)
    assert len(cost["notes"]) == 3


def test_no_engine_time_keeps_blended_but_not_split() -> None:
    cost = cost_figures(3600.0, 1.0, 500_000, 500_000, 0.0, 0.0)
    assert cost["usd_per_m_total"] == pytest.approx(1.0)
    assert cost["usd_per_m_input"] is None and cost["usd_per_m_output"] is None


def test_goodput_cost_divides_the_whole_bill_by_good_tokens() -> None:
    cost = cost_figures(3600.0, 1.0, 500_000, 500_000, 1.0, 1.0)
    good = goodput_cost(cost, good_input_tokens=250_000, good_output_tokens=0)
    assert good["usd_per_m_total"] == pytest.approx(4.0)
    assert good["usd_per_m_input"] == pytest.approx(2.0)
    assert good["usd_per_m_output"] is None


def test_helpers() -> None:
    assert per_million(1.0, 0) is None
    assert per_million(None, 10) is None
    assert prefill_share(0.0, 0.0) is None
