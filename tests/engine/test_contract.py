"""The worker engine contract (jobrunner/engine/contract.py): our engine and the test doubles meet it, a custom
engine that does not is refused at the worker's load naming what it lacks, and an engine that cannot rebuild
itself is closed and built anew."""

from __future__ import annotations

import pytest

from jobrunner.driver.engine_factory import build_engine, rebuild_engine
from jobrunner.engine import SamplingParams, WorkerEngine
from jobrunner.engine.contract import check_worker_engine, missing_members
from jobrunner.spec import spec_from_dict
from tests.driver.fake_engine import FakeEngine
from tests.driver.secret_engine import SecretEngine


def _spec(tmp_path, source: str = "unused", **engine) -> object:
    return spec_from_dict({"name": "t", "model": {"source": source, "dtype": "float32"},
                           "input": {"url": str(tmp_path / "in.parquet"), "prompt_column": "prompt"},
                           "engine": {"max_num_seqs": 4, **engine}, "output": {"url": str(tmp_path / "out")}})


def test_our_engine_meets_the_contract_and_rebuilds_over_its_weights(tiny_llama_hf_dir, tmp_path):
    engine = build_engine(_spec(tmp_path, str(tiny_llama_hf_dir), num_kv_blocks=32))
    assert missing_members(engine) == [] and isinstance(engine, WorkerEngine)
    assert engine.block_size == 16 and engine.model_info["architecture"] == "LlamaForCausalLM"
    params = SamplingParams(max_tokens=5, temperature=0.0)
    before = engine.generate(["hello world"], params)
    rebuilt = engine.rebuild()
    assert rebuilt.model is engine.model and engine.runner is None  # the same weights; the old KV let go
    assert [o.output_token_ids for o in rebuilt.generate(["hello world"], params)] == \
        [o.output_token_ids for o in before]
    rebuilt.close()
    assert rebuilt.runner is None and rebuilt.scheduler is None


@pytest.mark.parametrize("double", [FakeEngine(), SecretEngine("k")])
def test_the_test_doubles_meet_it(double):
    assert missing_members(double) == [] and isinstance(double, WorkerEngine)


class _Partial:
    """An engine written against an older worker: no block_size, close or model_info; step is not a method."""

    tokenizer, device, num_unfinished_requests, step = None, "cpu", 0, "not callable"

    def add_request(self, *a, **k): ...

    def has_unfinished_requests(self): return False

    def stats(self): ...

    def rebuild(self): ...


def make_partial(spec) -> _Partial:
    return _Partial()


def test_a_custom_engine_that_misses_members_is_refused_naming_them(tmp_path):
    assert missing_members(_Partial()) == ["model_info", "block_size", "close", "step (not callable)"]
    with pytest.raises(TypeError) as info:
        build_engine(_spec(tmp_path, factory="tests.engine.test_contract:make_partial"))
    text = str(info.value)
    assert text.startswith("engine.factory 'tests.engine.test_contract:make_partial' returned a _Partial that "
                           "does not meet the worker engine contract")
    assert text.endswith("missing model_info, block_size, close, step (not callable)")
    with pytest.raises(TypeError, match="model_info \\(not a dict\\)"):
        engine = FakeEngine()
        engine.model_info = None
        check_worker_engine(engine, "x")


def test_an_engine_that_cannot_rebuild_is_closed_and_built_anew(tmp_path):
    spec = _spec(tmp_path, factory="tests.driver.fake_engine:make_engine", factory_options={"no_rebuild": True})
    engine = build_engine(spec)
    fresh, loaded = rebuild_engine(engine, spec)
    assert loaded and engine.closed and fresh is not engine and not fresh.closed
    again, loaded = rebuild_engine(FakeEngine(), spec)
    assert not loaded and isinstance(again, FakeEngine)
