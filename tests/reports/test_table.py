"""Table cells: formatting (no exponent, no NaN), run labels, ratios against the first run."""

from __future__ import annotations

from jobrunner.reports.table import fmt_pct, fmt_seconds, fmt_usd, run_labels


def test_formatting_never_uses_exponents_or_nan() -> None:
    assert [fmt_usd(v) for v in (9.708e-05, 0.1, 0.01629, 2.5, 1234.5, None, float("nan"))] == [
        "$0.00009708", "$0.1000", "$0.01629", "$2.50", "$1,234.50", "n/a", "n/a"]
    assert [fmt_seconds(v) for v in (7.73e-05, 0.0773, 1.25, float("inf"))] == [
        "77.3 µs", "77.3 ms", "1.25 s", "n/a"]
    assert fmt_pct(None) == "n/a" and fmt_pct(0.0612) == "6.1%"


def test_run_labels_are_distinct() -> None:
    def run(label: str, quant: str) -> dict:
        return {"run": {"label": label, "model": {"quantization": quant}}}

    assert run_labels([run("a", "none"), run("b", "none")]) == ["a", "b"]
    assert run_labels([run("a", "none"), run("a", "int8")]) == ["a [none]", "a [int8]"]
    # Same name and quantization: the output folder tells them apart, else the date, else a number.
    assert run_labels([run("a", "int8"), run("a", "int8")]) == ["a", "a #2"]
    night = [run("a", "int8"), run("a", "int8")]
    night[0]["run"].update(url="s3://b/nightly/2026-11-29/", date="2026-11-29")
    night[1]["run"].update(url="s3://b/nightly/2026-11-30", date="2026-11-30")
    assert run_labels(night) == ["a [2026-11-29]", "a [2026-11-30]"]
