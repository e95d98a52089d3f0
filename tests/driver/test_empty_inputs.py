"""Empty files in an input folder are skipped with one warning naming them; only an input with no rows at
all is refused, naming its files. (One empty file used to refuse the whole job: "missing column 'prompt'
...; columns are: " with an empty list.)"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobrunner.driver.plan import plan_job
from jobrunner.io.reader import InputError
from jobrunner.spec import spec_from_dict
from tests.driver.helpers import fake_spec, write_prompts


def _empties(folder) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a-placeholder.parquet").write_bytes(b"")
    pq.write_table(pa.table({}), folder / "b-no-schema.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), folder / "c-no-rows.parquet")
    return [f"file://{folder}/a-placeholder.parquet (0 bytes)", f"file://{folder}/b-no-schema.parquet "
            "(0 rows, no columns)", f"file://{folder}/c-no-rows.parquet (0 rows)"]


def test_empty_files_are_skipped_with_a_warning_naming_them(tmp_path, caplog):
    named = _empties(tmp_path / "in")
    write_prompts(tmp_path / "in" / "d-real.parquet", 12)
    spec = spec_from_dict(fake_spec(str(tmp_path / "in"), str(tmp_path / "out")))
    with caplog.at_level(logging.WARNING, logger="jobrunner"):
        plan = plan_job(spec)
    assert [r.getMessage() for r in caplog.records] == [
        f"input.url {str(tmp_path / 'in')!r}: skipping 3 empty input file(s): {', '.join(named)}"]
    assert plan.num_rows == 12 and len(plan.shards) == 2 and len(plan.files) == 4  # all 4 pinned for a resume
    files = plan.shards.columns.file
    assert {files.get(i) for i in range(len(plan.shards))} == {f"file://{tmp_path}/in/d-real.parquet"}


def test_an_input_of_only_empty_files_is_refused_naming_them(tmp_path):
    named = _empties(tmp_path / "in")
    spec = spec_from_dict(fake_spec(str(tmp_path / "in"), str(tmp_path / "out")))
    with pytest.raises(InputError) as info:
        plan_job(spec)
    assert str(info.value) == (f"input.url {str(tmp_path / 'in')!r}: the dataset has no rows: every input file "
                               f"is empty ({', '.join(named)})")
