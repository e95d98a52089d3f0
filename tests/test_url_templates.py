"""{date}, {datetime} and {run_id} in the input and output URLs of a job spec."""

from __future__ import annotations

import datetime as dt
import re
import uuid

import pytest

from jobrunner import url_templates
from jobrunner.spec import SpecError, spec_from_dict
from jobrunner.url_templates import fill_url, template_values

NOW = dt.datetime(2026, 12, 3, 1, 30, 5, tzinfo=dt.timezone.utc)


def _spec(input_url: str, output_url: str) -> dict:
    return {"name": "nightly", "input": {"url": input_url, "prompt_column": "prompt"}, "output": {"url": output_url}}


def test_values_from_the_clock_or_the_environment(monkeypatch):
    values = template_values(NOW, environ={})
    assert values["date"] == "2026-12-03" and values["datetime"] == "2026-12-03T01-30-05Z"
    assert re.fullmatch("[0-9a-f]{12}", values["run_id"]), values["run_id"]
    assert template_values(NOW, environ={})["run_id"] != values["run_id"]  # a fresh id per spec load
    monkeypatch.setattr(url_templates.uuid, "uuid4", lambda: uuid.UUID("0123456789abcdef0123456789abcdef"))
    assert template_values(NOW, environ={})["run_id"] == "0123456789ab"  # a random UUID's first 12 hex digits
    monkeypatch.undo()
    pinned = template_values(NOW, environ={"JOBRUNNER_DATE": "2026-12-02", "JOBRUNNER_RUN_ID": "night-41"})
    assert (pinned["date"], pinned["run_id"], pinned["datetime"]) == ("2026-12-02", "night-41", values["datetime"])


def test_a_spec_fills_both_urls_with_one_set_of_values(monkeypatch):
    monkeypatch.setenv("JOBRUNNER_DATE", "2026-12-02")
    monkeypatch.delenv("JOBRUNNER_RUN_ID", raising=False)
    spec = spec_from_dict(_spec("s3://in/{date}/*.jsonl", "s3://out/nightly/{date}/{run_id}"))
    assert spec.input.url == "s3://in/2026-12-02/*.jsonl"
    prefix, run_id = spec.output.url.rsplit("/", 1)
    assert prefix == "s3://out/nightly/2026-12-02" and len(run_id) == 12
    plain = spec_from_dict(_spec("in/{a,b}.parquet", "out/${x}"))  # brace globs and other text stay as written
    assert (plain.input.url, plain.output.url) == ("in/{a,b}.parquet", "out/${x}")


def test_an_unknown_placeholder_is_refused_naming_the_field():
    with pytest.raises(SpecError, match=r"<spec>: output.url: unknown placeholder \{data\} in 'out/\{data\}'; "
                                        r"the known ones are \{date\}, \{datetime\}, \{run_id\}"):
        spec_from_dict(_spec("in.parquet", "out/{data}"))
    with pytest.raises(ValueError, match="unknown placeholder"):
        fill_url("x/{nope}", template_values(NOW, environ={}), "f")



@pytest.mark.parametrize("bad", ["2026-12-4", "2026-13-01", "20261204", "tonight"])
def test_a_logical_date_not_written_yyyy_mm_dd_is_refused(monkeypatch, bad):
    """$JOBRUNNER_DATE names the night's folder and orders the trend: '2026-12-4' would sort after '2026-12-10'."""
    with pytest.raises(ValueError, match=r"JOBRUNNER_DATE=.*YYYY-MM-DD"):
        template_values(NOW, environ={"JOBRUNNER_DATE": bad})
    monkeypatch.setenv("JOBRUNNER_DATE", bad)
    with pytest.raises(SpecError, match=r"<spec>: \$JOBRUNNER_DATE="):
        spec_from_dict(_spec("in.parquet", "out/{date}"))
