#!/bin/bash
# What `dtype: auto` chooses in N fresh processes on this machine, and the bench throughput of auto / bfloat16 /
# float32 on the same prompts (one run each). Usage, from the checkout (numbers are only worth reporting on a
# quiet machine, e.g. under `cpu-run --exclusive`):
#   scripts/dtype_auto_check.sh [PROCESSES=5] [NUM_PROMPTS=32] [MAX_TOKENS=32]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PROCESSES=${1:-5}; NUM_PROMPTS=${2:-32}; MAX_TOKENS=${3:-32}
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'); JOBRUNNER_CPU_CAPABILITY=${JOBRUNNER_CPU_CAPABILITY:-unset}"
for i in $(seq "$PROCESSES"); do
  "$PY" -c "
import torch
from jobrunner.models.factory import choose_dtype, describe_dtype_choice
_, why = choose_dtype('auto', torch.device('cpu'))
print('process $i: dtype auto ->', describe_dtype_choice(why))"
done
for dtype in auto bfloat16 float32; do
  "$PY" -m jobrunner.cli bench --prompts examples/data/prompts.parquet --num-prompts "$NUM_PROMPTS" \
    --max-tokens "$MAX_TOKENS" --ignore-eos --dtype "$dtype" --json 2>/dev/null | tail -1 | "$PY" -c "
import json, sys
d = json.load(sys.stdin); o = d['ours']
print(f\"bench --dtype $dtype: model dtype {d['workload']['dtype']}, {o['output_tokens_per_s']:.1f} out tok/s, \"
      f\"{o['total_tokens_per_s']:.1f} total tok/s, {o['seconds']:.2f} s\")"
done
