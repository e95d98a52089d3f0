"""The model runner's one path: every backend brings its own step runner (eager, plus its fixed-shape runner),
the runner never asks which, and a failing non-torch backend gives way to torch (or its deterministic twin)."""

import ast
from pathlib import Path

import pytest
import torch
from tiny import engine_from_hf

from jobrunner.attention import FixedShapeLimits, make_step_runner
from jobrunner.attention.decode_graphs import DecodeGraphs
from jobrunner.attention.invariant_ops import INVARIANT_BACKEND
from jobrunner.attention.step_graphs import StepGraphs
from jobrunner.attention.torch_backend import TORCH_BACKEND
from jobrunner.attention.triton_backend import TritonBackend
from jobrunner.engine import SamplingParams

RUNNER = Path(__file__).resolve().parents[2] / "jobrunner" / "engine" / "model_runner.py"


def test_model_runner_never_asks_which_backend_or_path_runs():
    tree = ast.parse(RUNNER.read_text(encoding="utf-8"))
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "isinstance" not in calls                                 # no `isinstance(self.graphs, ...)`
    compared = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(x, ast.Attribute) and x.attr == "name" for x in [n.left, *n.comparators])]
    assert compared == []                                            # no `backend.name == ...`
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {"jobrunner.attention.decode_graphs", "jobrunner.attention.step_graphs"} & imported


def test_each_backend_brings_its_fixed_shape_runner():
    kv = torch.zeros(1, 2, 9 * 16, 2, 8)
    limits = FixedShapeLimits(16, max_num_seqs=4, max_num_tokens=32, max_model_len=128, scratch_block=8, capture=False)
    model = torch.nn.Identity()
    triton = TritonBackend(4, 2, 16, torch.device("cpu"), max_num_seqs=4, max_model_len=128)
    assert isinstance(make_step_runner(TORCH_BACKEND, model, kv, limits).fixed, DecodeGraphs)
    assert isinstance(make_step_runner(triton, model, kv, limits).fixed, StepGraphs)
    assert make_step_runner(INVARIANT_BACKEND, model, kv, limits).fixed is None   # fixed order: always eager
    for backend in (TORCH_BACKEND, triton, INVARIANT_BACKEND):
        steps = make_step_runner(backend, model, kv)                 # fixed-shape steps off
        assert steps.fixed is None and steps.stats() == {} and steps.backend is backend


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_failing_backend_falls_back_for_the_rest_of_the_run(hf_llama, tokenizer, caplog, deterministic):
    """The triton backend on a CPU without Triton's interpreter fails on its first step (a real failure: its
    kernel cannot launch here): one warning, one count, the torch (or fixed-order) backend's tokens."""
    prompts = ["one two three four", "five six"]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = [o.output_token_ids for o in engine_from_hf(hf_llama, tokenizer, deterministic=deterministic)
            .generate(prompts, params)]
    engine = engine_from_hf(hf_llama, tokenizer, deterministic=deterministic)
    shape = engine.model.shape
    engine.runner.use_backend(TritonBackend(shape.num_heads, shape.num_kv_heads, 16, torch.device("cpu")))
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want
    stats = engine.runner.stats()
    assert stats["attention_fallbacks"] == 1 and caplog.text.count("falling back") == 1
    assert stats["attention_backend"] == ("invariant" if deterministic else "torch")
