"""What a CUDA graph capture must never record, tested on CPU with stand-ins for torch.cuda's graph API (the
capture helper and the graph runners are the real code): no autograd in any captured forward, built models
without grad, and graphs dropped and captured again when the weights move after capture (a module swapped,
e.g. a model quantized after its engine was built)."""

from __future__ import annotations

import contextlib

import torch
from tiny import make_hf_model

from jobrunner.attention import decode_graphs as decode_graphs_module
from jobrunner.attention import graph_capture
from jobrunner.attention.decode_graphs import DecodeGraphs, DecodeRow
from jobrunner.attention.graph_capture import WeightsGuard, capture_graph
from jobrunner.models.loader import build_model, load_weights


class _Stream:
    def __init__(self, *_args) -> None:
        pass

    def wait_stream(self, _other) -> None:
        pass


class _FakeGraph:
    """Replays by running the recorded forward again into the captured output."""

    def __init__(self) -> None:
        self.forward = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _cpu_cuda_api(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda _s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *_a, **_k: contextlib.nullcontext())


def test_every_captured_forward_runs_without_autograd(monkeypatch):
    _cpu_cuda_api(monkeypatch)
    layer = torch.nn.Linear(4, 4)
    assert layer.weight.requires_grad and torch.is_grad_enabled()
    seen = []

    def forward():
        seen.append(torch.is_grad_enabled())
        return layer(torch.ones(2, 4))

    graph, output, pool = capture_graph(torch.device("cpu"), None, forward)
    assert seen == [False, False, False]  # two warm-up runs, then the recorded one
    assert output.grad_fn is None and not output.requires_grad and pool == "pool"
    assert torch.is_grad_enabled()  # the caller's mode is left as it was


def test_built_models_hold_no_parameter_that_requires_grad():
    hf = make_hf_model("llama")
    model = build_model(hf.config, torch.float32, torch.device("cpu"))
    load_weights(model, hf.state_dict().items())
    assert not any(p.requires_grad for p in model.parameters())


def test_the_weights_guard_sees_a_swapped_module_once_and_nothing_else():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    guard = WeightsGuard(model)
    assert not guard.moved()
    torch.nn.Linear(4, 4)  # a module registered elsewhere: the pointers are read again, and have not moved
    assert not guard.moved() and guard.num_moves == 0
    model[1] = torch.nn.Linear(4, 4)  # swapped after capture
    assert guard.moved() and guard.num_moves == 1
    assert not guard.moved()  # said once
    model[0].weight = torch.nn.Parameter(torch.zeros(4, 4))
    guard.capture_started()  # a capture over the weights as they are now
    assert not guard.moved()


def test_decode_graphs_are_captured_again_when_a_module_is_swapped_after_capture(monkeypatch):
    captures = []

    def fake_capture(device, pool, forward):
        captures.append(forward)
        with torch.no_grad():
            return _FakeGraph(), forward(), "pool"

    monkeypatch.setattr(decode_graphs_module, "capture_graph", fake_capture)
    hf = make_hf_model("llama")
    model = build_model(hf.config, torch.float32, torch.device("cpu"))
    load_weights(model, hf.state_dict().items())
    s = model.shape
    kv = torch.zeros(s.num_layers, 2, 3 * 16, s.num_kv_heads, s.head_dim)
    graphs = DecodeGraphs(model, kv, 16, max_num_seqs=4, max_model_len=32, scratch_block=2, capture=True)
    rows = [DecodeRow(5, 0, 0, [0]), DecodeRow(7, 0, 16, [1])]
    shape = graphs.shape_for(rows)
    graphs.run(rows, shape)
    graphs.run(rows, shape)
    assert len(captures) == 1 and graphs.num_replays == 2
    model.layers[0].mlp.down_proj = torch.nn.Linear(s.intermediate_size, s.hidden_size, bias=False)  # swapped
    graphs.run(rows, shape)
    assert len(captures) == 2 and graphs.stats()["graph_weight_moves"] == 1 and len(graphs.graphs) == 1
    graphs.run(rows, shape)
    assert len(captures) == 2  # the new graph is replayed from then on
    assert graph_capture.weights_key(model) == graphs.weights.key
