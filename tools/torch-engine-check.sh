#!/usr/bin/env bash
# Runs on the device (after tools/gpu-build.sh here, which stages the kiln CLI in .carry/kiln/):
# issue 26's check of kiln-torch, item 4, in one call of about 6 minutes on one H100 or H200 (16
# cores). Every bundled torchvision classifier (Swin-T and ViT-B/16 among them), YOLOv8n (Ultralytics
# from .whl/) and the models Kiln has never seen, exported with kiln-torch (python/, from the working
# tree), checked on the CPU executor (rel L2 ≤ 1e-5) and in FP32 (TF32 off, ≤ 1e-4) and FP16 (≤ 1e-2,
# same top-1 / argmax) engines against PyTorch, their layer counts beside the bundled definitions',
# `kiln build`, `kiln run` and `kiln bench` on each exported file; then the segmentation models at
# batch 1 and 16 (520×520) beside PyTorch FP16 + CUDA graph. tools/torch_engine_check.py says how.
# Results in $OUT/torch-check: results.md (the table), results.json (for `python3 tools/bench_all.py
# render results.json --tables segmentation`), kiln.log, check.log, device.log.
#
#   here:    bash tools/gpu-build.sh        (and Ultralytics' wheels in .whl/: see docs/IMPORT.md, "Checks")
#   device:  bash tools/torch-engine-check.sh        carry [".carry", ".whl"], timeout_s 600
#
# A part of it: name groups (classify, new, segment, yolo) or models, and flags of
# tools/torch_engine_check.py, e.g. `bash tools/torch-engine-check.sh segment --bench`; no argument
# means `all --bench`.
set -uo pipefail
cd "$(dirname "$0")/.."
export KILN_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib
# PyTorch bundles its own cuDNN and refuses an older one first on the path: only kiln gets KILN_LD.
unset LD_LIBRARY_PATH
# torch.export warns of its own deprecations once per export: not ours to act on.
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore::FutureWarning YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/kiln-torch-ultralytics
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$(mktemp -d)}
KILN=${KILN:-.carry/kiln/kiln}
[ -x "$KILN" ] || { echo "no kiln binary at $KILN: run tools/gpu-build.sh first and carry .carry" >&2; exit 2; }
mkdir -p "$OUT/torch-check"
# Ultralytics and ultralytics-thop (pure Python; the device has their other needs).
if ls .whl/ultralytics-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kiln-torch-site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/kiln-torch-site
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__, "cudnn", torch.backends.cudnn.version())'
  python3 -c 'import ultralytics; print("ultralytics", ultralytics.__version__)' || echo "no ultralytics: yolov8n will fail its export"
  echo "kiln $(cat .carry/kiln/COMMIT 2>/dev/null || echo '?')"
  date -u
} 2>&1 | tee "$OUT/torch-check/device.log"

[ $# -eq 0 ] && set -- all --bench
python3 tools/torch_engine_check.py --kiln "$KILN" --out "$OUT/torch-check" "$@" 2>&1 | tee "$OUT/torch-check/check.log"
exit "${PIPESTATUS[0]}"
