#!/usr/bin/env bash
# The verdict on a lent GPU machine (no network, no weights, no ray), in two phases that each fit one call:
#
#   OUT=/some/dir bash scripts/gpu_check.sh                # PHASE=core (default): at most ~4 minutes
#   OUT=/some/dir PHASE=extra bash scripts/gpu_check.sh    # a later call, only if device time is left
#
# core (ENV_S + TESTS_S + BENCH_S + 20 = 15 + 100 + 105 + 20 = 240 s at most) answers what decides defaults:
#   env    nvidia-smi, python / torch / transformers / CUDA versions, which optional packages are missing
#   tests  pytest tests/gpu -m "not slow" with the plugin scripts/gpu_check_results.py: one JSON line per test
#          in $OUT/tests.jsonl, written as each test ends. Tests needing a package the image lacks (jsonschema,
#          xgrammar) skip with the reason. float32 greedy parity with transformers for torch/triton attention
#          with and without CUDA graphs, the triton kernel against torch in bf16 at head_dim 128, bf16
#          head_dim-128 parity over 32 tokens (backends, graphs vs eager), int8/int4 inside graphs
#   bench  scripts/gpu_bench.py --runs core --steady-steps 32 -> $OUT/gpu_bench.json (rewritten after every
#          run): the device's bandwidth and bf16 GEMM rate measured first; bf16 (then float32) greedy parity
#          with transformers over 32 tokens per backend and graphs on/off; a Llama-3-8B-shaped random bf16
#          model, 256 prompts of 512 tokens prefilled, then 32 decode steps at the full batch timed (set-up
#          reported apart as setup_s): triton+graphs and torch eager, each against its roofline
# extra (BENCH_S 300): scripts/gpu_bench.py --runs extra -> $OUT/gpu_bench_extra.json: transformers' continuous
#          batching, fp8/int8/int4 runs of the 8B shape (output lengths uniform in [1, 256], drained), the
#          quantized-linear kernels (scripts/gpu_quant_bench.py), the decode A/B of split-K attention and
#          one-step-late readback (scripts/gpu_decode_ab.py; reported, not judged)
# verdict scripts/gpu_check_verdict.py merges everything in $OUT into ONE $OUT/gpu_check.json: verdict_core
#          (the core checks) and verdict (all checks) pass|fail|incomplete, per-check results (thresholds in
#          that script's docstring); run after each phase, so an extra phase adds to the core's file
# Without CUDA (CPU-only mode) the tests stage shows what skips and why, the bench runs a tiny CPU smoke
# (BENCH_ARGS_CPU), and every threshold is "skipped": the verdict is "incomplete".
# Logs go to $OUT/<stage>.log, packed at the end of the phase into $OUT/logs_<phase>.tar.gz (the device tool
# returns at most 8 files: both phases leave 7), one "stage rc seconds" line per stage to gpu_check_status.txt.
# Exit status: 0 when this phase's verdict is pass, 1 otherwise (the script itself always ends).
set -u

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
PHASE="${PHASE:-core}"
case "$PHASE" in
  core) ENV_S="${ENV_S:-15}"; TESTS_S="${TESTS_S:-100}"; BENCH_S="${BENCH_S:-105}"; RUNS=core
        BENCH_OUT="$OUT/gpu_bench.json"; STEADY="--steady-steps 32" ;;
  extra) ENV_S="${ENV_S:-15}"; TESTS_S=0; BENCH_S="${BENCH_S:-300}"; RUNS=extra
         BENCH_OUT="$OUT/gpu_bench_extra.json"; STEADY="" ;;
  *) echo "PHASE must be core or extra, got '$PHASE'"; exit 2 ;;
esac
TEST_PATHS="${TEST_PATHS:-tests/gpu}"
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  CPU_ONLY=""
  BENCH_ARGS="${BENCH_ARGS:-}"
else
  CPU_ONLY="--cpu-only"
  BENCH_ARGS="${BENCH_ARGS:-${BENCH_ARGS_CPU:---device cpu --tiny}}"
  echo "no CUDA device: CPU-only mode (GPU tests skip, tiny CPU bench, thresholds not judged)"
fi
STATUS="$OUT/gpu_check_status.txt"
[ "$PHASE" = core ] && : > "$STATUS"   # an extra phase appends to the core's status lines
FAILED=0

stage() {  # stage NAME LIMIT_S CMD...
  local name="$1" limit="$2"
  shift 2
  echo "=== $name (limit ${limit}s) ==="
  local start rc
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" > >(tee "$OUT/$name.log") 2>&1
  rc=$?
  [ "$rc" -eq 124 ] && echo "!!! $name timed out after ${limit}s"
  [ "$rc" -ne 0 ] && FAILED=$((FAILED + 1))
  echo "$name rc=$rc seconds=$(( $(date +%s) - start ))" | tee -a "$STATUS"
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
for name in ("transformers", "tokenizers", "safetensors", "pyarrow", "pytest", "triton", "ray", "jsonschema",
             "xgrammar"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as exc:
        print(name, "not installed:", exc)
PYEOF
}

stage "env_$PHASE" "$ENV_S" bash -c "$(declare -f env_info); PY='$PY' env_info"
if [ "$PHASE" = core ]; then
  : > "$OUT/tests.jsonl"
  export GPU_CHECK_RESULTS="$OUT/tests.jsonl"   # one JSON line per test, written as each ends (a timeout keeps them)
  # shellcheck disable=SC2086  # TEST_PATHS / BENCH_ARGS / CPU_ONLY are word lists
  stage tests "$TESTS_S" env PYTHONPATH="scripts:$PYTHONPATH" "$PY" -m pytest -q -rs -p no:cacheprovider \
    -p gpu_check_results --continue-on-collection-errors $TEST_PATHS -m "not slow"
fi
# shellcheck disable=SC2086
stage "bench_$PHASE" "$BENCH_S" "$PY" scripts/gpu_bench.py --out "$BENCH_OUT" --runs "$RUNS" $STEADY \
  --budget-s "$(( BENCH_S * 2 / 3 ))" $BENCH_ARGS

timeout 20 "$PY" scripts/gpu_check_verdict.py "$OUT" $CPU_ONLY
KEY=$([ "$PHASE" = core ] && echo verdict_core || echo verdict)
VERDICT=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$OUT/gpu_check.json" \
  "$KEY" 2>/dev/null || echo missing)

# the device tool returns at most 8 files: this phase's logs go into one archive (gpu_check.json already holds
# the environment, the tests and the bench); gpu_quant_bench.json is inside gpu_bench_extra.json
LOGS=$(cd "$OUT" && ls ./*_"$PHASE".log $([ "$PHASE" = core ] && echo ./tests.log) 2>/dev/null)
# shellcheck disable=SC2086
[ -n "$LOGS" ] && tar czf "$OUT/logs_$PHASE.tar.gz" -C "$OUT" $LOGS && (cd "$OUT" && rm -f $LOGS)
rm -f "$OUT/gpu_quant_bench.json"
echo "=== summary of phase $PHASE ($FAILED stages failed; $KEY $VERDICT) ==="
cat "$STATUS"
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$VERDICT" = pass ]
