#!/usr/bin/env bash
# One-call verdict on a lent GPU machine (no network, no weights, no ray): fits one 8-minute device call.
#
#   OUT=/some/dir bash scripts/gpu_check.sh      # from the repository root
#
# Stages (each under its own `timeout`; a failure is recorded and the next stage still runs; each stage writes
# its results as it goes, so a stage killed by its timeout keeps what finished):
#   env    nvidia-smi, python / torch / transformers / CUDA versions, which optional packages are missing
#   tests  pytest tests/gpu -m "not slow" with the plugin scripts/gpu_check_results.py: one JSON line per test
#          in $OUT/tests.jsonl, written as each test ends. Tests needing a package the image lacks (jsonschema,
#          xgrammar) skip with the reason. float32 greedy parity with transformers for torch/triton attention
#          with and without CUDA graphs, the triton kernel against torch in bf16 at head_dim 128, bf16
#          head_dim-128 parity over 32 tokens (backends, graphs vs eager), int8/int4 inside graphs
#   bench  scripts/gpu_bench.py -> $OUT/gpu_bench.json (rewritten after every run): bf16 greedy parity with
#          transformers over 32 tokens, then a Llama-3-8B-shaped random bf16 model, 256 rows, 512-token
#          prompts, output lengths uniform in [1, 256]: triton+graphs, torch, transformers' continuous
#          batching, then fp8/int8/int4 (errors recorded per run)
#   verdict scripts/gpu_check_verdict.py merges everything into ONE $OUT/gpu_check.json with
#          verdict pass|fail|incomplete and per-check results (thresholds in that script's docstring)
# Without CUDA (CPU-only mode) the tests stage shows what skips and why, the bench runs a tiny CPU smoke
# (BENCH_ARGS_CPU), and every threshold is "skipped": the verdict is "incomplete".
# Logs go to $OUT/<stage>.log, one "stage rc seconds" line per stage to $OUT/gpu_check_status.txt.
# Whole run: at most ENV_S + TESTS_S + BENCH_S + 20 seconds (default 30 + 150 + 270 + 20 = 470 s, < 8 min).
# Exit status: 0 when the verdict is pass, 1 otherwise (the script itself always ends; see gpu_check.json).
set -u

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
ENV_S="${ENV_S:-30}"
TESTS_S="${TESTS_S:-150}"
BENCH_S="${BENCH_S:-270}"
TEST_PATHS="${TEST_PATHS:-tests/gpu}"
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  CPU_ONLY=""
  BENCH_ARGS="${BENCH_ARGS:-}"
else
  CPU_ONLY="--cpu-only"
  BENCH_ARGS="${BENCH_ARGS:-${BENCH_ARGS_CPU:---device cpu --tiny --runs torch,hf}}"
  echo "no CUDA device: CPU-only mode (GPU tests skip, tiny CPU bench, thresholds not judged)"
fi
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
for name in ("transformers", "tokenizers", "safetensors", "pyarrow", "pytest", "triton", "ray", "jsonschema",
             "xgrammar"):
    try:
        mod = __import__(name)
        print(name, getattr(mod, "__version__", "?"))
    except ImportError as exc:
        print(name, "not installed:", exc)
PYEOF
}

stage env "$ENV_S" bash -c "$(declare -f env_info); PY='$PY' env_info"
: > "$OUT/tests.jsonl"
export GPU_CHECK_RESULTS="$OUT/tests.jsonl"   # one JSON line per test, written as each ends (a timeout keeps them)
# shellcheck disable=SC2086  # TEST_PATHS / BENCH_ARGS / CPU_ONLY are word lists
stage tests "$TESTS_S" env PYTHONPATH="scripts:$PYTHONPATH" "$PY" -m pytest -q -rs -p no:cacheprovider \
  -p gpu_check_results --continue-on-collection-errors $TEST_PATHS -m "not slow"
stage bench "$BENCH_S" "$PY" scripts/gpu_bench.py --out "$OUT/gpu_bench.json" \
  --budget-s "$(( BENCH_S - 60 ))" $BENCH_ARGS

timeout 20 "$PY" scripts/gpu_check_verdict.py "$OUT" $CPU_ONLY
VERDICT=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['verdict'])" "$OUT/gpu_check.json" \
  2>/dev/null || echo missing)

echo "=== summary ($FAILED stages failed; verdict $VERDICT) ==="
cat "$STATUS"
[ "$VERDICT" = pass ]
