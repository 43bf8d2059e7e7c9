#!/usr/bin/env bash
# docs/BENCHMARKS.md's tables from one device run (tools/bench_all.py): Kiln beside every PyTorch peer.
#
#   here:    bash tools/gpu-build.sh              stages the kiln CLI in .carry/kiln/; .whl/ must hold the
#                                                 Ultralytics wheels (ultralytics, ultralytics-thop)
#   device:  bash tools/bench-all.sh              carry [".carry", ".whl"], timeout_s 600 (about 9 minutes)
#   here:    python3 tools/bench_all.py render <files_at>/results.json    rewrites docs/BENCHMARKS.md's tables
#
# Extra arguments go to `bench_all.py device` (e.g. --budget 500, --models resnet50,yolov8n).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
# Kiln gets the system cuDNN through bench_all.py; PyTorch must not see it.
unset LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1 YOLO_OFFLINE=1
if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
  export PYTHONPATH=/tmp/site
else
  echo "Ultralytics not installed: the YOLO peers will fail"
fi
python3 tools/bench_all.py device --kiln .carry/kiln/kiln --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
