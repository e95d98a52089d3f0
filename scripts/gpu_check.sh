#!/usr/bin/env bash
# One-call health and speed check on a lent GPU machine (no network, no weights, no ray).
#
#   OUT=/some/dir bash scripts/gpu_check.sh      # from the repository root
#
# Stages (each under its own `timeout`; a failure is recorded and the next stage still runs):
#   env    nvidia-smi, python / torch / transformers / CUDA versions
#   tests  pytest tests/gpu -m "not slow"  -> $OUT/junit.xml: float32 greedy parity with transformers for
#          torch/triton attention with and without CUDA graphs, the triton kernel against torch in bf16 at
#          head_dim 128, bf16 head_dim-128 parity (backends, graphs vs eager), int8/int4 inside graphs
#   bench  scripts/gpu_bench.py -> $OUT/gpu_bench.json: Llama-3-8B-shaped random bf16 model, 256 rows,
#          512-token prompts, output lengths uniform in [1, 256]; torch, triton, triton+graphs,
#          fp8:triton+graphs (recorded as an error while fp8 does not exist) and transformers' generate_batch
# Then everything is merged into ONE file, $OUT/gpu_check.json (stages, environment, test outcomes, bench).
# Logs go to $OUT/<stage>.log, one "stage rc seconds" line per stage to $OUT/gpu_check_status.txt.
# Whole run: at most ENV_S + TESTS_S + BENCH_S + 20 seconds (default 30 + 150 + 270 + 20 = 470 s, < 8 min).
# Exit status: the number of failed stages.
set -u

OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export OUT
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
ENV_S="${ENV_S:-30}"
TESTS_S="${TESTS_S:-150}"
BENCH_S="${BENCH_S:-270}"
TEST_PATHS="${TEST_PATHS:-tests/gpu}"   # overridable for a quick CPU smoke run of this script
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
  --budget-s "$(( BENCH_S - 60 ))" $BENCH_ARGS

merge() {  # one JSON with everything: stage statuses, environment log, test outcomes, bench report
  timeout 20 "$PY" - "$OUT" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
report = {"stages": {}, "tests": None, "bench": None}
for line in open(os.path.join(out, "gpu_check_status.txt")):
    name, rc, secs = line.split()
    report["stages"][name] = {"rc": int(rc.split("=")[1]), "seconds": int(secs.split("=")[1])}
try:
    report["environment"] = open(os.path.join(out, "env.log")).read()[-4000:]
except OSError as exc:
    report["environment"] = f"missing: {exc}"
try:
    cases = {}
    for case in ET.parse(os.path.join(out, "junit.xml")).iter("testcase"):
        bad = [c for c in case if c.tag in ("failure", "error", "skipped")]
        outcome = bad[0].tag if bad else "passed"
        cases[f"{case.get('classname')}::{case.get('name')}"] = {
            "outcome": outcome, "seconds": float(case.get("time", 0)),
            "message": (bad[0].get("message") or "")[:500] if bad else None}
    outcomes = [c["outcome"] for c in cases.values()]
    report["tests"] = {"counts": {k: outcomes.count(k) for k in sorted(set(outcomes))}, "cases": cases}
except (OSError, ET.ParseError) as exc:
    report["tests"] = {"error": f"{type(exc).__name__}: {exc}"}
try:
    report["bench"] = json.load(open(os.path.join(out, "gpu_bench.json")))
except (OSError, ValueError) as exc:
    report["bench"] = {"error": f"{type(exc).__name__}: {exc}"}
with open(os.path.join(out, "gpu_check.json"), "w") as f:
    json.dump(report, f, indent=1, default=str)
print("wrote", os.path.join(out, "gpu_check.json"))
PYEOF
}
merge

echo "=== summary ($FAILED failed) ==="
cat "$STATUS"
exit "$FAILED"
