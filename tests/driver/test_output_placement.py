"""An output that overlaps the input is refused in every output.mode, before the input is planned or anything
is written (driver/output_guard.py): the default `resume` would otherwise write parts into the input folder,
and the next run would read its own output as input. Locations are compared resolved: `file://`, relative and
trailing-slash spellings of one folder are one folder; a glob input refuses only an output it would match."""

from __future__ import annotations

import pytest

from jobrunner.driver.job import run_job
from jobrunner.driver.output import OutputError, describe_output, read_previous_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, new_bucket, planned, write_prompts

MODES = ["resume", "error", "overwrite"]


def _spec(input_url, output_url, mode="resume", storage_options=None):
    return spec_from_dict(fake_spec(str(input_url), str(output_url), storage_options, output={"mode": mode}))


def _inside_input(out, inp) -> str:
    return (f"output.url '{out}' is or lies inside input.url '{inp}' (resolved: {out}), which is read "
            "recursively: the job's parts would be read back as input by the next run; use an output.url "
            "outside the input")


@pytest.fixture
def data(tmp_path):
    write_prompts(tmp_path / "data" / "in.parquet", 4)
    return tmp_path / "data"


@pytest.mark.parametrize("mode", MODES)
def test_an_output_inside_the_input_folder_is_refused_in_every_mode_and_nothing_is_written(mode, tmp_path, data):
    out = data / "results"
    with pytest.raises(OutputError) as info:
        run_job(_spec(data, out, mode), show_progress=False)
    assert str(info.value) == _inside_input(out, data)
    assert not out.exists()
    with pytest.raises(OutputError) as info:  # validate: the same refusal
        describe_output(_spec(data, out, mode), *planned(_spec(data, out, mode)))
    assert str(info.value) == _inside_input(out, data)


@pytest.mark.parametrize("mode", MODES)
def test_the_input_inside_the_output_is_refused_in_every_mode(mode, tmp_path):
    write_prompts(tmp_path / "out" / "in.parquet", 4)
    inp, out = tmp_path / "out" / "in.parquet", tmp_path / "out"
    with pytest.raises(OutputError) as info:
        read_previous_output(_spec(inp, out, mode))
    assert str(info.value) == (
        f"input.url '{inp}' lies inside output.url '{out}' (resolved: {inp}): the job would write among its "
        "input (a resume deletes files under parts/ that no shard committed, output.mode=overwrite everything); "
        "use an output.url that does not hold the input")


def test_spellings_of_one_folder_are_one_folder(tmp_path, data, monkeypatch):
    for inp, out in [(f"file://{data}/", str(data)), (str(data), f"file://{data}/results/"),
                     (f"{data}/", f"{data}/./results")]:
        with pytest.raises(OutputError, match="is or lies inside input.url"):
            read_previous_output(_spec(inp, out))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError) as info:
        read_previous_output(_spec("data", "data/results/"))
    assert str(info.value) == (f"output.url 'data/results/' is or lies inside input.url 'data' (resolved: "
                               f"{data / 'results'}), which is read recursively: the job's parts would be read "
                               "back as input by the next run; use an output.url outside the input")
    read_previous_output(_spec("data", "data-out"))  # a sibling whose name starts alike is no overlap


def test_a_glob_input_refuses_only_an_output_it_would_read(data):
    out = data / "results"
    assert read_previous_output(_spec(f"{data}/*.parquet", out)).entries == []  # parts are two levels down
    with pytest.raises(OutputError) as info:
        read_previous_output(_spec(f"{data}/**/*.parquet", out))
    assert str(info.value) == (f"output.url '{out}' lies where input.url '{data}/**/*.parquet' matches: its parts "
                               f"({out}/parts/part-0.parquet) would be read back as input by the next run; use an "
                               "output.url the pattern does not match")


def test_object_storage_prefixes_overlap_by_path_parts(s3_server):
    opts = s3_server["storage_options"]
    bucket = new_bucket(s3_server)
    write_prompts(f"s3://{bucket}/in/a.parquet", 4, storage_options=opts)
    with pytest.raises(OutputError) as info:
        read_previous_output(_spec(f"s3://{bucket}/in/", f"s3://{bucket}/in/out", storage_options=opts))
    assert str(info.value) == (f"output.url 's3://{bucket}/in/out' is or lies inside input.url 's3://{bucket}/in/' "
                               f"(resolved: {bucket}/in/out), which is read recursively: the job's parts would be "
                               "read back as input by the next run; use an output.url outside the input")
    assert read_previous_output(_spec(f"s3://{bucket}/in", f"s3://{bucket}/in-out", storage_options=opts)).entries == []
