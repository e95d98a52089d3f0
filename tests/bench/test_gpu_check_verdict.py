"""scripts/gpu_check.sh's merge and verdict on canned stage outputs, and its per-test results plugin."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
spec = importlib.util.spec_from_file_location("gpu_check_verdict", SCRIPTS / "gpu_check_verdict.py")
verdict_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verdict_mod)


def _runner(name: str) -> dict:
    """What a run's engine.runner.stats() says when it ran as named (gpu_bench records it)."""
    backend, _, graphs = name.rpartition(":")[2].partition("+")
    stats = {"attention_backend": backend, "attention_fallbacks": 0}
    if graphs:
        stats.update(graphs_captured=12, graph_capture_failures=0)
    return stats


def _run(tok: float, name: str | None = None, **extra) -> dict:
    out = {"output_tokens_per_s": tok, "timed_out": False, **extra}
    if name:  # an engine run: its backend, graphs and runner counters
        out.update(attention_backend=name.rpartition(":")[2].partition("+")[0], cuda_graphs="+graphs" in name,
                   runner=_runner(name), num_fixed_shape_steps=40 if "+graphs" in name else 0)
    return out


def _parity(bf16_diff: float, f32_match: float = 1.0, combos: int = 4) -> dict:
    names = ["torch", "torch+graphs", "triton", "triton+graphs"][:combos]

    def combo(n, share, diff):
        return {"vs_transformers": {"rows_full_match": share}, "max_logprob_diff_teacher_forced": diff,
                "runner": _runner(n), "num_fixed_shape_steps": 30 if "+graphs" in n else 0}

    return {"run": "parity", "max_new_tokens": 32, "num_combinations": 4,
            "bfloat16": {n: combo(n, 0.5, bf16_diff) for n in names},  # bf16 drifts free-running: not judged
            "float32": {n: combo(n, f32_match, 2e-5) for n in names}}


def _stage_dir(tmp_path: Path, runs: dict, tests: list[dict], status: str = "env rc=0 seconds=3\ntests rc=0 "
               "seconds=90\nbench rc=0 seconds=250\n") -> str:
    (tmp_path / "gpu_check_status.txt").write_text(status)
    (tmp_path / "env_core.log").write_text("torch 2.11 cuda 12.8 available True\n")
    (tmp_path / "tests.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tests) + '{"test": "torn')
    (tmp_path / "gpu_bench.json").write_text(json.dumps({"runs": runs}))
    return str(tmp_path)


GOOD_TESTS = [{"test": "tests/gpu/a.py::t1", "outcome": "passed", "seconds": 1.0, "message": None},
              {"test": "tests/gpu/a.py::t2", "outcome": "skipped", "seconds": 0.0,
               "message": "Skipped: xgrammar is not installed"}]
GOOD_RUNS = {"parity": _parity(0.012),
             "triton+graphs": _run(9000.0, "triton+graphs", roofline_share=0.55,
                                   roofline={"step_bytes": 2.1e10, "weight_bytes": 1.6e10, "rows": 180.5,
                                             "mean_context": 576.0, "roofline_decode_tokens_per_s": 41000.0,
                                             "step_flops": 6.1e12, "bytes_s": 0.0046, "flops_s": 0.0089,
                                             "binding": "flops", "bytes_per_s": 4.5e12,
                                             "bf16_flop_per_s": 6.9e14}),
             "torch": _run(4000.0, "torch"), "hf": _run(2500.0),
             "fp8:triton+graphs": _run(12600.0, "fp8:triton+graphs"),
             "int8:triton+graphs": {"error": "RuntimeError: no kernel"},
             "int4:triton+graphs": _run(8000.0, "int4:triton+graphs")}


def test_all_thresholds_met_is_a_pass(tmp_path):
    report = verdict_mod.build_report(_stage_dir(tmp_path, GOOD_RUNS, GOOD_TESTS))
    checks = report["checks"]
    assert report["verdict"] == "pass", checks
    assert checks["vs_transformers_continuous_batching"]["value"] == 3.6
    assert checks["fp8_vs_bf16_batch_256"]["value"] == 1.4
    assert checks["quantized_runs"]["value"]["int8:triton+graphs"] == {"error": "RuntimeError: no kernel"}
    assert checks["quantized_runs"]["value"]["int4:triton+graphs"]["vs_bf16"] == 0.889
    roofline = checks["roofline_share_llama3_8b"]
    assert roofline["status"] == "pass" and roofline["value"] == {"triton+graphs": 0.55}
    assert roofline["detail"].startswith("flops bind: a decode step of 180.5 rows x 576.0 tokens reads 21.0 GB "
                                         "(4.60 ms at 4.50 TB/s measured) and does 6.10 TFLOP (8.90 ms at 690")
    assert checks["paths_as_named"] == {"status": "pass", "value": 12, "judged": True, "detail": None,
                                        "threshold": checks["paths_as_named"]["threshold"]}  # 4 runs + 2 x 4 combos
    assert report["tests"]["counts"] == {"passed": 1, "skipped": 1}    # the torn last line is ignored


def test_a_missed_threshold_or_failed_test_is_a_fail(tmp_path):
    slow_fp8 = dict(GOOD_RUNS, **{"fp8:triton+graphs": _run(8500.0, "fp8:triton+graphs")})  # slower than bf16
    (tmp_path / "a").mkdir()
    report = verdict_mod.build_report(_stage_dir(tmp_path / "a", slow_fp8, GOOD_TESTS))
    assert report["verdict"] == "fail" and report["checks"]["fp8_vs_bf16_batch_256"]["status"] == "fail"
    (tmp_path / "b").mkdir()
    failed = GOOD_TESTS + [{"test": "tests/gpu/b.py::t3", "outcome": "failed", "seconds": 2.0, "message": "boom"}]
    report = verdict_mod.build_report(_stage_dir(tmp_path / "b", GOOD_RUNS, failed))
    assert report["verdict"] == "fail" and "boom" in report["checks"]["gpu_tests"]["detail"]
    (tmp_path / "c").mkdir()
    wrong_step = dict(GOOD_RUNS, parity=_parity(0.9))  # a bf16 token 0.9 nats off transformers, teacher-forced
    report = verdict_mod.build_report(_stage_dir(tmp_path / "c", wrong_step, GOOD_TESTS))
    assert report["verdict"] == "fail" and report["checks"]["bf16_parity_32_tokens"]["detail"].startswith(
        "bf16 torch: 0.9; bf16 torch+graphs: 0.9")
    (tmp_path / "e").mkdir()
    inexact = dict(GOOD_RUNS, parity=_parity(0.012, f32_match=0.875))
    report = verdict_mod.build_report(_stage_dir(tmp_path / "e", inexact, GOOD_TESTS))
    assert report["checks"]["bf16_parity_32_tokens"]["detail"].startswith("float32 torch: 88% of rows")
    (tmp_path / "d").mkdir()
    far = dict(GOOD_RUNS, **{"triton+graphs": dict(GOOD_RUNS["triton+graphs"], roofline_share=0.3)})
    report = verdict_mod.build_report(_stage_dir(tmp_path / "d", far, GOOD_TESTS))
    assert report["verdict"] == "fail" and report["checks"]["roofline_share_llama3_8b"]["status"] == "fail"


def test_a_silent_fallback_fails_naming_the_run(tmp_path):
    """A run named triton+graphs whose runner fell back to torch and replayed no graph: the speed checks would
    compare torch with torch, so the verdict fails and says which run and how."""
    fell_back = dict(GOOD_RUNS["triton+graphs"], num_fixed_shape_steps=0,
                     runner={"attention_backend": "torch", "attention_fallbacks": 1, "graphs_captured": 0})
    report = verdict_mod.build_report(_stage_dir(tmp_path, dict(GOOD_RUNS, **{"triton+graphs": fell_back}),
                                                 GOOD_TESTS))
    check = report["checks"]["paths_as_named"]
    assert report["verdict"] == "fail" and check["status"] == "fail" and check["value"] == 4
    assert check["detail"] == ("triton+graphs: ran attention backend 'torch', not 'triton'; triton+graphs: 1 "
                               "attention fallback(s); triton+graphs: no CUDA graph captured; triton+graphs: no "
                               "step replayed a graph")


def test_a_timed_out_stage_keeps_what_finished_and_is_incomplete(tmp_path):
    partial = {k: GOOD_RUNS[k] for k in ("parity", "triton+graphs", "torch")}   # bench killed after 3 runs
    status = "env rc=0 seconds=3\ntests rc=124 seconds=150\nbench rc=124 seconds=270\n"
    report = verdict_mod.build_report(_stage_dir(tmp_path, partial, GOOD_TESTS, status))
    checks = report["checks"]
    assert report["verdict"] == "incomplete"
    assert checks["graphs_faster_than_eager"]["status"] == "pass"
    assert checks["vs_transformers_continuous_batching"]["status"] == "missing"
    assert checks["gpu_tests"]["status"] == "missing" and checks["gpu_tests"]["value"] == {"passed": 1, "skipped": 1}


def test_the_core_phase_alone_has_a_core_verdict_and_the_extra_phase_adds_its_runs(tmp_path):
    core_runs = {k: GOOD_RUNS[k] for k in ("parity", "triton+graphs", "torch")}
    out = _stage_dir(tmp_path, core_runs, GOOD_TESTS)
    report = verdict_mod.build_report(out)
    assert report["verdict_core"] == "pass" and report["verdict"] == "incomplete"
    assert report["checks"]["vs_transformers_continuous_batching"]["status"] == "missing"
    extra_runs = {k: v for k, v in GOOD_RUNS.items() if k not in core_runs}
    (tmp_path / "gpu_bench_extra.json").write_text(json.dumps({"runs": extra_runs}))
    report = verdict_mod.build_report(out)
    assert report["verdict_core"] == "pass" and report["verdict"] == "pass"
    assert set(report["bench"]["runs"]) == set(GOOD_RUNS)


def test_cpu_only_mode_judges_nothing(tmp_path):
    report = verdict_mod.build_report(_stage_dir(tmp_path, {"torch": _run(50.0, "torch")}, GOOD_TESTS),
                                      cpu_only=True)
    assert report["verdict"] == "incomplete"
    assert {c["status"] for c in report["checks"].values() if c["judged"]} == {"skipped"}


def test_results_plugin_writes_one_line_per_test_as_it_goes(tmp_path):
    (tmp_path / "test_canned.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2\n"
        "def test_skip():\n    pytest.importorskip('no_such_module_here', reason='not on this image')\n")
    (tmp_path / "test_broken.py").write_text("import no_such_module_either\n")
    results = tmp_path / "tests.jsonl"
    env = dict(os.environ, GPU_CHECK_RESULTS=str(results), PYTHONPATH=f"{SCRIPTS}{os.pathsep}"
               f"{os.environ.get('PYTHONPATH', '')}")
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check_results",
                    "--continue-on-collection-errors",
                    str(tmp_path)], env=env, cwd=tmp_path, capture_output=True, timeout=120)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    outcomes = {line["test"].split("::")[-1]: line["outcome"] for line in lines}
    assert outcomes == {"test_broken.py": "error", "test_ok": "passed", "test_bad": "failed",
                        "test_skip": "skipped"}
    assert "not on this image" in next(line["message"] for line in lines if line["outcome"] == "skipped")


@pytest.mark.heavy  # both phases of scripts/gpu_check.sh in its CPU mode (~50 s): the verdict logic is tested above
def test_both_phases_leave_at_most_eight_files_and_one_report(tmp_path):
    """The device tool returns at most 8 files from $OUT: the CPU-only mode of both phases (a tiny bench)
    leaves its logs packed, and the extra phase's report still holds the core's environment."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "TEST_PATHS": "tests/gpu/test_quant_cuda.py",
           "BENCH_ARGS": "--device cpu --tiny --runs torch --num-prompts 2 --output-len 2"}
    repo = SCRIPTS.parent
    for phase in ("core", "extra"):
        done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=repo, env={**env, "PHASE": phase},
                              capture_output=True, text=True, timeout=600)
        assert "=== summary of phase " + phase in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and {"gpu_check.json", "logs_core.tar.gz", "logs_extra.tar.gz"} <= set(files), files
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["cpu_only"] and "torch" in report["environment"]
    assert set(report["stages"]) == {"probe_core", "env_core", "tests", "parity", "bench_core", "probe_extra",
                                     "env_extra", "bench_extra"}
    assert "parity" in report["bench"]["runs"]  # the parity stage's own file, merged


def test_the_core_stage_limits_add_up_to_210_s_with_the_imports_and_verdicts():
    """The core phase fits one 240 s device call with slack: every stage's default limit (the cold torch import
    in the probe, four verdicts) adds up to at most 210 s, as the script's header says."""
    import re

    text = (SCRIPTS / "gpu_check.sh").read_text()
    defaults = dict(re.findall(r'(\w+_S)="\$\{\1:-(\d+)\}"', text.split("case")[0] + text.split("core)")[1]
                               .split(";;")[0]))
    total = sum(int(defaults[k]) for k in ("PROBE_S", "ENV_S", "TESTS_S", "PARITY_S", "BENCH_S")) \
        + 4 * int(defaults["VERDICT_S"])
    assert total <= 210, defaults
    assert re.search(r"#   total\s+" + str(total) + r"\b", text), "the header's budget table says another total"


def test_a_split_parity_file_is_merged_into_the_core_report(tmp_path):
    runs = {k: GOOD_RUNS[k] for k in ("triton+graphs", "torch")}
    out = _stage_dir(tmp_path, runs, GOOD_TESTS)
    report = verdict_mod.build_report(str(out))
    assert report["checks"]["bf16_parity_32_tokens"]["status"] == "missing"  # the parity stage never ran
    (tmp_path / "gpu_parity.json").write_text(json.dumps({"runs": {"parity": GOOD_RUNS["parity"]}}))
    report = verdict_mod.build_report(str(out))
    assert report["checks"]["bf16_parity_32_tokens"]["status"] == "pass"
