"""output.mode=overwrite deletes only an empty folder or an earlier output of the same job; anything else is
refused by `run` (before any lease or worker) and `validate`, naming what was found. Input containment is judged
on resolved paths, so symlinks cannot hide the input."""

from __future__ import annotations

import json
import os

import pytest

from jobrunner.driver.job import run_job
from jobrunner.driver.output import OutputError, describe_output
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, planned, write_prompts


def _spec(input_url, output_url):
    return spec_from_dict(fake_spec(str(input_url), str(output_url), output={"mode": "overwrite"}))


def _refused(input_url, output_url, match: str) -> str:
    """run and validate both refuse with a message matching `match`; returns it."""
    spec = _spec(input_url, output_url)
    with pytest.raises(OutputError, match=match) as info:
        run_job(spec, show_progress=False)
    with pytest.raises(OutputError, match=match):
        describe_output(spec, *planned(spec))
    return str(info.value)


def _job_output(path, job_name: str) -> None:
    (path / "parts").mkdir(parents=True)
    (path / "parts" / "part-00000-abc.parquet").write_bytes(b"x")
    (path / "_manifest.json").write_text(json.dumps({"job_name": job_name, "shards": {}}))
    (path / "_SUCCESS").write_text("")


@pytest.fixture
def data(tmp_path):
    write_prompts(tmp_path / "data" / "in.parquet", 4)
    return tmp_path / "data" / "in.parquet"


def test_foreign_files_and_underscore_folders_are_refused(tmp_path, data):
    out = tmp_path / "out"
    for name in ("_archive", "_raw"):
        (out / name).mkdir(parents=True)
        (out / name / "old.parquet").write_bytes(b"keep")
    message = _refused(data, out, "holds _archive/ and _raw/ not written by jobrunner")
    assert "only replaces an empty folder or an earlier output of job 'fake-job'" in message
    for name in ("notes.txt", "a.csv", "b.csv"):
        (out / name).write_text("keep")
    _refused(data, out, r"holds _archive/, _raw/ and 3 files \(a.csv, b.csv, notes.txt\) not written by jobrunner")
    assert (out / "_archive" / "old.parquet").read_bytes() == b"keep" and (out / "notes.txt").exists()


def test_a_foreign_file_among_a_jobs_own_entries_is_refused(tmp_path, data):
    out = tmp_path / "out"
    _job_output(out, "fake-job")
    (out / "parts" / "README.md").write_text("keep")
    _refused(data, out, r"holds 1 file \(parts/README.md\) not written by jobrunner")
    (out / "parts" / "README.md").unlink()
    (out / "_manifest.json").unlink()
    _refused(data, out, r"holds parts/ and 1 file \(_SUCCESS\) but no _manifest.json: not a jobrunner output")


def test_another_jobs_output_is_refused_and_the_same_jobs_accepted(tmp_path, data):
    out = tmp_path / "out"
    _job_output(out, "other")
    _refused(data, out, "is the output of job 'other', not of this job 'fake-job'")
    assert (out / "parts" / "part-00000-abc.parquet").exists()
    (out / "_manifest.json").write_text(json.dumps({"job_name": "fake-job", "shards": {}}))
    spec = _spec(data, out)
    assert describe_output(spec, *planned(spec)) == "output exists and will be deleted (output.mode=overwrite)"
    empty = tmp_path / "empty"
    empty.mkdir()
    spec = _spec(data, empty)
    assert describe_output(spec, *planned(spec)) == "output is empty: a new job"


def test_containment_is_judged_on_resolved_paths(tmp_path, data):
    # the output is a symlink to the input's folder
    os.symlink(tmp_path / "data", tmp_path / "out-link")
    _refused(data, tmp_path / "out-link", f"input.url .* lies inside output.url .*resolved: {data}")
    # the input is a symlink to a file inside the output
    (tmp_path / "out").mkdir()
    os.replace(data, tmp_path / "out" / "in.parquet")
    os.symlink(tmp_path / "out" / "in.parquet", data)
    _refused(data, tmp_path / "out", f"input.url .* lies inside output.url .*resolved: {tmp_path / 'out'}")
    assert (tmp_path / "out" / "in.parquet").exists()


def test_an_input_folder_holding_a_link_into_the_output_and_an_output_inside_the_input(tmp_path):
    write_prompts(tmp_path / "out" / "real.parquet", 4)
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "out" / "real.parquet", tmp_path / "data" / "link.parquet")
    _refused(tmp_path / "data", tmp_path / "out", "input file .*link.parquet resolves into output.url")
    assert (tmp_path / "out" / "real.parquet").exists()
    # a folder input is read recursively: an output inside it would be input (and deleted as output)
    _refused(tmp_path / "data", tmp_path / "data" / "results", "lies inside input.url")
