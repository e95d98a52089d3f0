"""Each sampling / engine setting is declared once, on the engine's dataclass; the job spec is built from it."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

import pytest
from pydantic import ValidationError, create_model

from jobrunner.driver.engine_factory import engine_config_kwargs
from jobrunner.engine import EngineConfig, SamplingParams
from jobrunner.engine.settings import check_settings, setting, settings_of
from jobrunner.spec import JOB_SAMPLING_DEFAULTS, EngineSpec, SamplingSpec, SpecError, load_spec, spec_from_dict
from jobrunner.spec_sections import section_fields

SPEC_ONLY = {EngineSpec: {"factory", "factory_options", "backend", "vllm_python", "vllm_options", "endpoint"},
             SamplingSpec: {"seed_per_row", "seed_column"}}  # the driver's row-seed rules (driver/row_seeds.py)


def _spec(**sections):
    return spec_from_dict({"name": "t", "input": {"url": "x.parquet", "prompt_column": "p"}, "output": {"url": "o"},
                           **sections})


def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


@pytest.mark.parametrize(("spec_cls", "engine_cls", "job_defaults"), [
    (SamplingSpec, SamplingParams, JOB_SAMPLING_DEFAULTS), (EngineSpec, EngineConfig, {})])
def test_spec_keys_are_the_engine_settings_with_their_defaults(spec_cls, engine_cls, job_defaults):
    settings = {s.name: s for s in settings_of(engine_cls)}
    assert set(spec_cls.model_fields) - SPEC_ONLY[spec_cls] == set(settings)
    for name, value in spec_cls().model_dump().items():
        if name in settings:
            want = job_defaults.get(name, _default(settings[name].field))
            assert value == (list(want) if isinstance(want, tuple) else want), name
            assert spec_cls.model_fields[name].description == settings[name].setting.description


def _outside(item) -> list[float]:
    """A value just outside each declared bound of one setting."""
    bounds = item.setting.bounds()
    step = 1 if item.annotation in (int, int | None) else 0.5
    offsets = {"ge": -step, "gt": 0, "le": step}
    return [bound + offsets[op] for op, bound in bounds.items()]


@pytest.mark.parametrize("item", [s for s in settings_of(SamplingParams) if s.setting.bounds()], ids=lambda s: s.name)
def test_spec_and_sampling_params_refuse_the_same_values(item):
    for value in _outside(item):
        with pytest.raises(SpecError, match=rf"sampling\.{item.name}: Input should be"):
            _spec(sampling={item.name: value})
        with pytest.raises(ValueError, match=rf"sampling parameter '{item.name}' must be"):
            SamplingParams(**{item.name: value})


@pytest.mark.parametrize("item", [s for s in settings_of(EngineConfig) if s.setting.bounds()], ids=lambda s: s.name)
def test_spec_and_engine_config_refuse_the_same_values(item):
    for value in _outside(item):
        with pytest.raises(SpecError, match=rf"engine\.{item.name}: Input should be"):
            _spec(engine={item.name: value})
        with pytest.raises(ValueError, match=rf"EngineConfig\.{item.name} must be"):
            EngineConfig(**{item.name: value})


def test_every_engine_setting_reaches_the_engine_config():
    values = {"max_num_seqs": 3, "max_num_batched_tokens": 99, "block_size": 8, "kv_cache_memory_bytes": 1 << 20,
              "gpu_memory_utilization": 0.5, "num_kv_blocks": 7, "enable_prefix_caching": False,
              "max_model_len": 256, "device": "cpu", "attention_backend": "torch", "use_cuda_graphs": True,
              "deterministic": True, "speculative": "ngram", "num_speculative_tokens": 3, "draft_quantization": "int4",
              "kv_cache_dtype": "fp8_e5m2", "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    assert set(values) == {s.name for s in settings_of(EngineConfig)}, "a new setting: add it to this test"
    config = EngineConfig(**engine_config_kwargs(_spec(engine=values, model={"dtype": "float32"})))
    assert {k: getattr(config, k) for k in values} == values and config.dtype == "float32"


@dataclass(frozen=True)
class _Knobs:
    """What adding a setting takes: one field made with setting(...)."""

    level: int = setting(2, description="How far.", ge=1, le=5)
    names: tuple[str, ...] = setting((), description="Which.")
    mode: str | None = setting(None, description="Optional text.")
    internal: bool = False


def test_one_field_is_a_whole_setting():
    model = create_model("_KnobsSpec", **section_fields(_Knobs, {"level": 3}))
    assert set(model.model_fields) == {"level", "names", "mode"}
    assert model().model_dump() == {"level": 3, "names": [], "mode": None}
    assert model(names=["a"]).names == ["a"] and model.model_fields["names"].description == "Which."
    with pytest.raises(ValidationError, match="less than or equal to 5"):
        model(level=6)
    with pytest.raises(ValueError, match=r"_Knobs\.level must be >= 1, got 0"):
        check_settings(_Knobs(level=0))
    with pytest.raises(ValueError, match="job defaults for _Knobs name no setting: levl"):
        section_fields(_Knobs, {"levl": 3})
    assert [f.name for f in fields(_Knobs)][-1] == "internal"


def test_speculative_off_unquoted_in_yaml_is_the_off_mode(tmp_path):
    # YAML 1.1 reads a bare `off` as false; the default is auto, so `off` is what a user writes to turn it off
    job = tmp_path / "job.yaml"
    head = "name: j\ninput: {url: in.parquet, prompt_column: p}\noutput: {url: out}\n"
    job.write_text(head + "engine: {speculative: off}\n")
    assert load_spec(job).engine.speculative == "off"
    job.write_text(head)
    assert load_spec(job).engine.speculative == "auto"
    assert load_spec(job, overrides=["engine.speculative=off"]).engine.speculative == "off"  # --set


def test_prefix_grouping_off_unquoted_in_yaml_is_the_off_mode(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: j\ninput: {url: in.parquet, prompt_column: p, prefix_grouping: off}\noutput: {url: out}\n")
    assert load_spec(job).input.prefix_grouping == "off"
    assert load_spec(job, overrides=["input.prefix_grouping=off"]).input.prefix_grouping == "off"  # --set
