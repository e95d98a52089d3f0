"""engine.attention_backend / engine.use_cuda_graphs / engine.kv_cache_dtype: validated in the spec and passed on
to EngineConfig."""

from __future__ import annotations

import pytest

from jobrunner.driver.engine_factory import engine_config_kwargs
from jobrunner.engine import EngineConfig
from jobrunner.spec import SpecError, spec_from_dict


def _spec(**engine):
    return spec_from_dict({"name": "t", "input": {"url": "x.parquet", "prompt_column": "prompt"},
                           "output": {"url": "out"}, "engine": engine})


def test_attention_backend_reaches_the_engine_config():
    kwargs = engine_config_kwargs(_spec())
    assert kwargs["attention_backend"] == "auto" and kwargs["use_cuda_graphs"] == "auto"
    config = EngineConfig(**engine_config_kwargs(_spec(attention_backend="triton", use_cuda_graphs=True)))
    assert config.attention_backend == "triton" and config.use_cuda_graphs is True


def test_unknown_attention_backend_is_named():
    with pytest.raises(SpecError, match=r"engine\.attention_backend"):
        _spec(attention_backend="flash")


def test_kv_cache_dtype_reaches_the_engine_config_and_a_bad_one_is_named():
    assert engine_config_kwargs(_spec())["kv_cache_dtype"] == "auto"
    assert EngineConfig(**engine_config_kwargs(_spec(kv_cache_dtype="fp8_e4m3"))).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SpecError, match=r"engine\.kv_cache_dtype: Input should be 'auto', 'fp8_e4m3' or 'fp8_e5m2'"):
        _spec(kv_cache_dtype="fp8")


def test_speculative_setting_reaches_the_engine_config():
    assert engine_config_kwargs(_spec())["speculative"] == "auto"
    config = EngineConfig(**engine_config_kwargs(_spec(speculative="ngram", num_speculative_tokens=3)))
    assert config.speculative == "ngram" and config.num_speculative_tokens == 3
    with pytest.raises(SpecError, match=r"engine\.speculative"):
        _spec(speculative=" ")
    # any other value names a draft model: validate / run check it as model.source (tests/cli)
    assert EngineConfig(**engine_config_kwargs(_spec(speculative="org/draft"))).speculative == "org/draft"
