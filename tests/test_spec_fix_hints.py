"""Spec errors that say the fix (issue 47): a key in the wrong section names the section it belongs in, a scalar
where a section goes shows the section's shape, a refused vLLM option names the job's own setting, a --set that
is not YAML is one line naming the --set, OpenAI's sampling names say what to write, `logprobs: true` is K 0."""

from __future__ import annotations

import re

import pytest

from jobrunner.engine.sampling_params import SamplingParams
from jobrunner.spec import SpecError, parse_overrides, spec_from_dict


def _spec(**sections) -> dict:
    return {"name": "t", "input": {"url": "x.parquet", "prompt_column": "p"}, "output": {"url": "o"}, **sections}


def _error(data: dict) -> str:
    with pytest.raises(SpecError) as exc:
        spec_from_dict(data)
    return str(exc.value)


def test_a_scalar_where_a_section_goes_shows_the_shape() -> None:
    assert _error(_spec(model="smollm2-135m-instruct")) == (
        "<spec>: invalid job spec:\n  model: expected a section (a mapping) like `model: {source: "
        "smollm2-135m-instruct}`, got str 'smollm2-135m-instruct'")
    assert "cluster: expected a section (a mapping) like `cluster: {num_workers: 4}`, got int 4" in \
        _error(_spec(cluster=4))


def test_a_misplaced_key_names_its_section() -> None:
    message = _error(_spec(system_prompt="be brief", sampling={"reasoning_parser": "none"}))
    assert message.splitlines()[1:] == [
        "  sampling.reasoning_parser: unknown field in sampling; it belongs in output: write output.reasoning_parser",
        "  system_prompt: unknown field in the top level; it belongs in input: write input.system_prompt"]
    data = _spec()
    data["input"]["task"] = "embed"
    assert "input.task: unknown field in input; it belongs in the top level: write task" in _error(data)
    assert "did you mean 'max_tokens'?" in _error(_spec(sampling={"max_tokenz": 3}))  # a typo: as before


def test_a_refused_vllm_option_names_the_jobs_setting() -> None:
    message = _error(_spec(engine={"backend": "vllm", "vllm_options": {"enforce_eager": True, "max_num_seqs": 8,
                                                                       "seed": 1}}))
    assert message == (
        "<spec>: invalid job spec:\n  engine.backend vllm: "
        "engine.vllm_options.enforce_eager: set by jobrunner from the spec; use engine.use_cuda_graphs "
        "(false = eager); engine.vllm_options.max_num_seqs: set by jobrunner from the spec; use "
        "engine.max_num_seqs; engine.vllm_options.seed: set by jobrunner from the spec; use sampling.seed "
        "(per request)")


def test_a_set_that_is_not_yaml_is_one_line() -> None:
    with pytest.raises(SpecError) as exc:
        parse_overrides(["sampling.stop=["])
    assert str(exc.value) == ("--set 'sampling.stop=[': the value is not valid YAML (expected the node content, but "
                              "found '<stream end>'); write a list as [a, b], a mapping as {k: v}, and put text that "
                              "is not YAML in quotes")


@pytest.mark.parametrize(("flag", "k"), [(True, 0), (False, None), (3, 3)])
def test_logprobs_true_is_the_sampled_token_only(flag, k) -> None:
    spec = spec_from_dict(_spec(sampling={"logprobs": flag, "prompt_logprobs": flag}))
    assert (spec.sampling.logprobs, spec.sampling.prompt_logprobs) == (k, k)
    assert SamplingParams(logprobs=flag).logprobs == k  # a per-row override reads it the same way


def test_openai_names_say_what_to_write() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "unknown sampling parameter 'max_completion_tokens': write max_tokens; unknown sampling parameter "
            "'top_logprobs': write logprobs: K (the sampled token and its top K alternatives; logprobs: true is K 0)")):
        SamplingParams.from_dict({"top_logprobs": 2, "max_completion_tokens": 5})
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\): nope; known: choice, "):
        SamplingParams.from_dict({"nope": 1})


@pytest.mark.parametrize(("values", "field"), [({"temperature": 2.5}, "temperature"), ({"temperature": -0.1},
                         "temperature"), ({"top_p": 1.5}, "top_p"), ({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -3}, "frequency_penalty"), ({"logprobs": 21}, "logprobs"),
                         ({"n": 129}, "n"), ({"logit_bias": {"5": 101}}, "logit_bias")])
def test_ranges_are_openais(values, field) -> None:
    with pytest.raises(ValueError, match=f"sampling parameter '{field}' must be"):
        SamplingParams.from_dict(values)
    assert SamplingParams.from_dict({"temperature": 2.0}).temperature == 2.0
