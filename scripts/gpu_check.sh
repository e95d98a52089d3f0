#!/usr/bin/env bash
# One-call health and speed check on a lent GPU machine (no network, no weights, no ray).
#
#   OUT=/some/dir bash scripts/gpu_check.sh      # from the repository root
#
# Stages (each under its own `timeout`; a failure is recorded and the next stage still runs):
#   env    nvidia-smi, python / torch / transformers / CUDA versions
#   tests  pytest tests/gpu tests/engine -m "not slow"  -> $OUT/junit.xml
#   bench  scripts/gpu_bench.py (Llama-3-8B-shaped random bf16 model; none, none without CUDA graphs, int8, int4) -> $OUT/gpu_bench.json
# Logs go to $OUT/<stage>.log, one "stage rc seconds" line per stage to $OUT/gpu_check_status.txt.
# Whole run: at most ENV_S + TESTS_S + BENCH_S seconds (default 45 + 170 + 255 = 470 s, under 8 minutes).
# Exit status: the number of failed stages.
set -u

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
ENV_S="${ENV_S:-45}"
TESTS_S="${TESTS_S:-170}"
BENCH_S="${BENCH_S:-255}"
TEST_PATHS="${TEST_PATHS:-tests/gpu tests/engine}"   # overridable for a quick CPU smoke run of this script
BENCH_ARGS="${BENCH_ARGS:-}"                         # e.g. "--device cpu --tiny"
STATUS="$OUT/gpu_check_status.txt"
: > "$STATUS"
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
for name in ("transformers", "tokenizers", "safetensors", "pyarrow", "pytest", "ray"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as exc:
        print(name, "not installed:", exc)
PYEOF
}

stage env "$ENV_S" bash -c "$(declare -f env_info); PY='$PY' env_info"
# shellcheck disable=SC2086  # TEST_PATHS / BENCH_ARGS are word lists
stage tests "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider $TEST_PATHS -m "not slow" \
  --junitxml="$OUT/junit.xml"
stage bench "$BENCH_S" "$PY" scripts/gpu_bench.py --out "$OUT/gpu_bench.json" \
  --budget-s "$(( BENCH_S - 70 ))" $BENCH_ARGS

echo "=== summary ($FAILED failed) ==="
cat "$STATUS"
exit "$FAILED"
