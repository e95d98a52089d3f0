#!/usr/bin/env bash
# The verdict on a lent GPU machine (no network, no weights, no ray), in two phases that each fit one call:
#
#   OUT=/some/dir bash scripts/gpu_check.sh                # PHASE=core (default): at most 210 s, imports included
#   OUT=/some/dir PHASE=extra bash scripts/gpu_check.sh    # a later call, only if device time is left
#
# Stage budget of the core phase (every second the script spends is inside one of these limits; a device call
# may run 240 s, so 30 s are left for the tool's own start and copy-back):
#
#   probe    15  cold `import torch` and whether CUDA is there (CPU-only mode otherwise)
#   env      15  nvidia-smi, python / torch / transformers / CUDA versions, which optional packages are missing
#   tests    60  pytest tests/gpu -m "not slow" in 4 processes (pytest-xdist -n 4 where installed, else 4 pytest
#                processes over the test files), with the plugin scripts/gpu_check_results.py: one JSON line per
#                test in $OUT/tests.jsonl, written as each test ends. Correctness: a fixed cap, no deadline inside
#   parity   35  scripts/gpu_bench.py --runs parity -> $OUT/gpu_parity.json: greedy tokens at head_dim 128 of
#                every (attention backend, CUDA graphs) combination against transformers, bf16 then float32.
#                Correctness: every combination runs (no timing deadline); only the stage's cap can cut it
#   bench    65  scripts/gpu_bench.py --runs core --steady-steps 32 -> $OUT/gpu_bench.json (rewritten after
#                every run): bandwidth and bf16 GEMM rate measured first; a Llama-3-8B-shaped random bf16 model
#                built through the loader (its load peak in the run's load_memory), 256 prompts of 512 tokens
#                prefilled, 32 decode steps at the full batch timed: triton+graphs and torch eager, each against
#                its roofline
#   verdict  4 x 5  scripts/gpu_check_verdict.py after env, tests, parity and bench (and from the exit trap):
#                ONE $OUT/gpu_check.json with verdict_core / verdict pass|fail|incomplete and every check, so
#                a stage cut at its limit still leaves the verdict of the others
#   total   210
#
# extra (BENCH_S 300): scripts/gpu_bench.py --runs extra -> $OUT/gpu_bench_extra.json: transformers' continuous
#          batching, fp8/int8/int4 runs of the 8B shape, the quantized-linear kernels (scripts/gpu_quant_bench.py),
#          the decode A/B of split-K attention and one-step-late readback (scripts/gpu_decode_ab.py; reported)
# Without CUDA (CPU-only mode) the tests stage shows what skips and why, parity and the bench run a tiny CPU
# smoke (BENCH_ARGS_CPU), and every threshold is "skipped": the verdict is "incomplete".
# Logs go to $OUT/<stage>.log, packed at the end of the phase into $OUT/logs_<phase>.tar.gz (the device tool
# returns at most 8 files: both phases leave 8), one "stage rc seconds" line per stage to gpu_check_status.txt.
# Exit status: 0 when this phase's verdict is pass, 1 otherwise (the script itself always ends).
set -u

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
PHASE="${PHASE:-core}"
PROBE_S="${PROBE_S:-15}"; VERDICT_S="${VERDICT_S:-5}"
case "$PHASE" in
  core) ENV_S="${ENV_S:-15}"; TESTS_S="${TESTS_S:-60}"; PARITY_S="${PARITY_S:-35}"; BENCH_S="${BENCH_S:-65}"
        RUNS=core; BENCH_OUT="$OUT/gpu_bench.json"; STEADY="--steady-steps 32" ;;
  extra) ENV_S="${ENV_S:-15}"; TESTS_S=0; PARITY_S=0; BENCH_S="${BENCH_S:-300}"; RUNS=extra
         BENCH_OUT="$OUT/gpu_bench_extra.json"; STEADY="" ;;
  *) echo "PHASE must be core or extra, got '$PHASE'"; exit 2 ;;
esac
TEST_PATHS="${TEST_PATHS:-tests/gpu}"
TEST_PROCS="${TEST_PROCS:-4}"
STATUS="$OUT/gpu_check_status.txt"
[ "$PHASE" = core ] && : > "$STATUS"   # an extra phase appends to the core's status lines
FAILED=0
CPU_ONLY=""
KEY=$([ "$PHASE" = core ] && echo verdict_core || echo verdict)

stage() {  # stage NAME LIMIT_S CMD...: the command under `timeout` (its kill grace inside the limit)
  local name="$1" limit="$2"
  shift 2
  echo "=== $name (limit ${limit}s) ==="
  local start rc
  start=$(date +%s)
  timeout -k 3 "$((limit > 4 ? limit - 3 : limit))" "$@" > >(tee "$OUT/$name.log") 2>&1
  rc=$?
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo "!!! $name timed out after ${limit}s"
  [ "$rc" -ne 0 ] && FAILED=$((FAILED + 1))
  echo "$name rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$STATUS"
}

verdict() {  # gpu_check.json from whatever the stages have left so far
  # shellcheck disable=SC2086  # CPU_ONLY is empty or one flag
  timeout -k 1 "$VERDICT_S" "$PY" scripts/gpu_check_verdict.py "$OUT" $CPU_ONLY > "$OUT/verdict_$PHASE.log" 2>&1
}

finish() {  # the exit trap: the last verdict, the logs packed (the device tool returns at most 8 files)
  trap - EXIT INT TERM
  verdict
  local logs
  logs=$(cd "$OUT" && ls ./*_"$PHASE".log $([ "$PHASE" = core ] && echo ./tests.log ./tests_*.log ./parity.log) \
    2>/dev/null)
  # shellcheck disable=SC2086
  [ -n "$logs" ] && tar czf "$OUT/logs_$PHASE.tar.gz" -C "$OUT" $logs && (cd "$OUT" && rm -f $logs)
  rm -f "$OUT/gpu_quant_bench.json"
  VERDICT=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$OUT/gpu_check.json" \
    "$KEY" 2>/dev/null || echo missing)
  echo "=== summary of phase $PHASE ($FAILED stages failed; $KEY $VERDICT) ==="
  cat "$STATUS"
  echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
  [ "$VERDICT" = pass ] && exit 0
  exit 1
}
trap finish EXIT
trap 'exit 1' INT TERM

probe() {
  "$PY" -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available()); \
sys.exit(0 if torch.cuda.is_available() else 3)"
}

env_info() {
  nvidia-smi || echo "nvidia-smi failed"
  "$PY" - <<'PYEOF'
import platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
    free, total = torch.cuda.mem_get_info()
    print(f"memory free {free / 2**30:.1f} GiB of {total / 2**30:.1f} GiB")
for name in ("transformers", "tokenizers", "safetensors", "pyarrow", "pytest", "xdist", "triton", "ray",
             "jsonschema", "xgrammar"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as exc:
        print(name, "not installed:", exc)
PYEOF
}

gpu_tests() {  # TEST_PROCS pytest processes: xdist's -n where installed, else the test files dealt round-robin
  local common=(-q -rs -p no:cacheprovider -p gpu_check_results --continue-on-collection-errors -m "not slow")
  # shellcheck disable=SC2086  # TEST_PATHS is a word list
  if "$PY" -c "import xdist" 2>/dev/null; then
    "$PY" -m pytest "${common[@]}" -n "$TEST_PROCS" $TEST_PATHS
    return
  fi
  # shellcheck disable=SC2086
  local files=() groups=() i=0 pids=() rc=0
  mapfile -t files < <(find $TEST_PATHS -name 'test_*.py' | sort)
  for f in "${files[@]}"; do groups[$((i % TEST_PROCS))]+="$f "; i=$((i + 1)); done
  for g in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    "$PY" -m pytest "${common[@]}" ${groups[$g]} > "$OUT/tests_$g.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  cat "$OUT"/tests_*.log
  return "$rc"
}

stage "probe_$PHASE" "$PROBE_S" bash -c "$(declare -f probe); PY='$PY' probe"
PROBE_RC=$(awk -v s="probe_$PHASE" '$1 == s {print $2}' "$STATUS" | tail -1)
if [ "$PROBE_RC" = rc=0 ]; then
  BENCH_ARGS="${BENCH_ARGS:-}"
else  # rc=3: torch without CUDA (a mode, not a failure); anything else: torch did not even import in time
  [ "$PROBE_RC" = rc=3 ] && FAILED=$((FAILED - 1))
  CPU_ONLY="--cpu-only"; BENCH_ARGS="${BENCH_ARGS:-${BENCH_ARGS_CPU:---device cpu --tiny}}"
  echo "no CUDA device: CPU-only mode (GPU tests skip, tiny CPU parity and bench, thresholds not judged)"
fi

stage "env_$PHASE" "$ENV_S" bash -c "$(declare -f env_info); PY='$PY' env_info"
verdict
if [ "$PHASE" = core ]; then
  : > "$OUT/tests.jsonl"
  export GPU_CHECK_RESULTS="$OUT/tests.jsonl"   # one JSON line per test, written as each ends (a timeout keeps them)
  stage tests "$TESTS_S" env PYTHONPATH="scripts:$PYTHONPATH" TEST_PATHS="$TEST_PATHS" TEST_PROCS="$TEST_PROCS" \
    PY="$PY" OUT="$OUT" bash -c "$(declare -f gpu_tests); gpu_tests"
  verdict
  # shellcheck disable=SC2086  # BENCH_ARGS is a word list; its --runs would override parity: parity goes last
  stage parity "$PARITY_S" "$PY" scripts/gpu_bench.py --out "$OUT/gpu_parity.json" $BENCH_ARGS --runs parity
  verdict
fi
# shellcheck disable=SC2086
stage "bench_$PHASE" "$BENCH_S" "$PY" scripts/gpu_bench.py --out "$BENCH_OUT" --runs "$RUNS" $STEADY \
  --budget-s "$(( BENCH_S * 2 / 3 ))" $BENCH_ARGS
exit 0   # the trap writes the verdict and the summary
