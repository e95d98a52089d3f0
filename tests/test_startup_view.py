"""A run's start-up by stage: the worker's stages (driver/actor.startup_stages), the stopwatch the engine's
load marks, and the one line the run summary and `report` show (jobrunner/startup_view.py)."""

from __future__ import annotations

import types

import pytest
import torch

from jobrunner.driver.actor import startup_stages
from jobrunner.models import stopwatch
from jobrunner.models.llama import make_embedding
from jobrunner.models.stopwatch import Stopwatch
from jobrunner.startup_view import describe_startup, last_startup


def test_stopwatch_marks_each_stage_from_the_previous_one(monkeypatch):
    now = [100.0]  # the stopwatch's clock, moved by hand: exact seconds, whatever the machine's load
    monkeypatch.setattr(stopwatch, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    clock = Stopwatch()
    now[0] += 0.02
    clock.mark("a")
    now[0] += 5.0  # not counted: skipped
    clock.skip()
    now[0] += 0.004
    clock.mark("b")
    now[0] += 0.01
    clock.mark("a")  # a stage marked twice adds up
    assert clock.stages == {"a": 0.03, "b": 0.004}


def test_worker_stages_add_up_to_its_startup():
    info = {"load_stages_s": {"model_source": 0.5, "load_weights": 1.0, "engine": 0.25}}
    stages = startup_stages(100.0, 101.5, 101.75, 106.0, 2.0, info)
    assert stages == {"process": 1.5, "wait": 0.25, "imports": 2.0, "model_source": 0.5, "load_weights": 1.0,
                      "engine": 0.25, "other": 0.5}
    assert sum(stages.values()) == pytest.approx(6.0)
    # a custom engine (engine.factory) reports nothing of its own: its whole build is one stage
    assert startup_stages(100.0, 101.0, 101.0, 103.0, 0.0, None) == {"process": 1.0, "wait": 0.0, "load": 2.0}


def _manifest() -> dict:
    return {
        "runs": [{"startup": {"plan_s": 9.0}},
                 {"startup": {"plan_s": 0.7, "ray_start_s": 5.6,
                              "workers": {"w0": {"placed_s": 0.5, "ready_s": 9.1, "first_token_s": 11.0},
                                          "w1": {"placed_s": 0.6, "ready_s": 8.0, "first_token_s": 9.5},
                                          "w2": {"placed_s": 0.4}}}}],
        "workers": {"w1": {"startup_stages_s": {"process": 1.5, "wait": 0.0, "imports": 4.1, "engine": 0.8}}},
    }


def test_the_summary_line_names_the_first_ready_worker_and_its_stages():
    view = last_startup(_manifest())
    assert view["first"] == "w1" and view["num_ready"] == 2 and view["slowest_ready_s"] == 9.1
    assert describe_startup(view) == (
        "planning 0.7s; Ray start 5.6s; worker w1 placed 0.6s, ready 8.0s, first token 9.5s after it was asked "
        "for (its load: process 1.5s, imports 4.1s, engine 0.8s); 2 workers ready, the last after 9.1s")


def test_runs_without_a_startup_record_say_nothing():
    assert last_startup({"runs": [{"wall_s": 3.0}]}) is None and describe_startup(None) is None
    assert describe_startup(last_startup({"runs": [{"startup": {"plan_s": 0.2, "workers": {}}}]})) == \
        "planning 0.2s"


def test_an_embedding_built_on_meta_skips_its_random_init():
    with torch.device("meta"):
        meta = make_embedding(1000, 64)
    assert meta.weight.is_meta and meta.weight.shape == (1000, 64)
    real = make_embedding(1000, 64)  # elsewhere: nn.Embedding's own N(0, 1) init, as before
    assert 0.9 < real.weight.std().item() < 1.1


def test_the_summary_line_carries_the_load_memory():
    from jobrunner.driver.actor import load_memory

    manifest = _manifest()
    info = {"weights_bytes": 270_000_000, "load_host_anon_peak_bytes": 600_000_000,
            "load_host_anon_rise_bytes": 262_000_000, "load_device_peak_bytes": None, "source": "x"}
    manifest["workers"]["w1"].update(load_memory(info))
    assert load_memory(info) == {"weights_bytes": 270_000_000, "load_host_anon_peak_bytes": 600_000_000,
                                 "load_host_anon_rise_bytes": 262_000_000}
    assert "(its load: process 1.5s, imports 4.1s, engine 0.8s; weights 0.27 GB, load peak +0.26 GB host)" in \
        describe_startup(last_startup(manifest))
