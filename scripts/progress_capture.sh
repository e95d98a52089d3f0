#!/bin/bash
# Capture what a person sees of `jobrunner run jobs/example.yaml` (= make run): on a terminal (through
# `script`, a pseudo-tty) and in a Ray job's logs (a local Ray head, `jobrunner submit --wait`).
# Usage, from the checkout: scripts/progress_capture.sh OUT_DIR   (writes tty.typescript, tty.txt, rayjob.log)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?OUT_DIR}; mkdir -p "$OUT"
BIN=$PWD/.venv/bin
export PYTHONPATH=${PYTHONPATH:-$PWD}
rm -rf "$OUT/out-tty" "$OUT/out-rayjob"
# 1. terminal: the raw bytes, then a readable copy (each carriage-return redraw on its own line)
script -q -e -c "$BIN/jobrunner run jobs/example.yaml --set output.url=$OUT/out-tty" "$OUT/tty.typescript" >/dev/null
tr '\r' '\n' < "$OUT/tty.typescript" | sed 's/\x1b\[[0-9;]*[A-Za-z]//g' | grep -v '^\s*$' > "$OUT/tty.txt"
grep -c $'\x1b\\[0m' "$OUT/tty.typescript" | sed 's/^/lines with \\x1b[0m: /' >> "$OUT/tty.txt"
# 2. Ray job logs: a local head (only this script's processes; shut down by Ray's own Cluster helper)
RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$("$BIN/python" -c 'import uuid; print(uuid.uuid4().hex)') "$BIN/python" - "$OUT" <<'PY'
import os, socket, subprocess, sys
from ray.cluster_utils import Cluster

out = sys.argv[1]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": True,
                                                        "dashboard_host": "127.0.0.1", "dashboard_port": port})
try:
    cmd = [".venv/bin/jobrunner", "submit", "jobs/example.yaml", "--address", f"http://127.0.0.1:{port}", "--wait",
           "--set", f"input.url={os.getcwd()}/examples/data/prompts.parquet", "--set", f"output.url={out}/out-rayjob"]
    with open(f"{out}/rayjob.log", "w") as log:
        status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"submit exit status: {status}", file=log)
finally:
    cluster.shutdown()
PY
