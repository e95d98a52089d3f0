#!/bin/bash
# Run one job N times (like N nightly runs; each to its own output folder), then report them as a trend and
# take a headless-Chromium screenshot of the page (the trend measurement of issue 16).
#   scripts/trend_runs.sh [N=5] [ROWS=16] [MAX_TOKENS=16]   -> out/nightly/<UTC time>/, out/nightly-trend.{html,png}
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-5}; ROWS=${2:-16}; MAX_TOKENS=${3:-16}
BIN=.venv/bin
mkdir -p out/nightly
$BIN/python - "$ROWS" <<'PY'
import sys, pyarrow.parquet as pq
table = pq.read_table("examples/data/prompts.parquet").slice(0, int(sys.argv[1]))
pq.write_table(table, "out/nightly-prompts.parquet")
PY
for i in $(seq 1 "$N"); do
  stamp=$(date -u +%Y-%m-%dT%H%M%S)
  $BIN/jobrunner run jobs/example.yaml --no-progress --set input.url=out/nightly-prompts.parquet \
    --set sampling.max_tokens="$MAX_TOKENS" --set output.url="out/nightly/$stamp" --set output.mode=overwrite
done
$BIN/jobrunner report 'out/nightly/*'
$BIN/jobrunner report 'out/nightly/*' --out out/nightly-trend.html
$BIN/jobrunner report 'out/nightly/*' --format csv --out out/nightly-trend.csv
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,1100 \
  --screenshot="$PWD/out/nightly-trend.png" "file://$PWD/out/nightly-trend.html" 2>/dev/null
echo "screenshot: out/nightly-trend.png"
