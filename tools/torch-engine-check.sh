#!/usr/bin/env bash
# Runs on the device (after tools/gpu-build.sh here, which stages the kiln CLI in .carry/kiln/):
# issue 26's engine check of kiln-torch. Exports torchvision models with kiln-torch (python/, from
# the working tree), builds FP32 (TF32 off) and FP16 engines with `kiln compare`, compares them with
# PyTorch (FP32 ≤ 1e-4 rel L2; FP16 ≤ 1e-2 and the same top-1 / argmax) and times the segmentation
# models at batch 1 and 16 against PyTorch FP16 + CUDA graph. Results: $OUT/torch-check/results.md
# (the tables for docs/BENCHMARKS.md and the issue's closing note), results.json, kiln.log.
#
#   device run:  bash tools/torch-engine-check.sh              carry: [".carry"]
#
# Everything takes more than one device call's 10 minutes on an H100; split it by group:
#   bash tools/torch-engine-check.sh classify      resnet50 mobilenet_v3_large efficientnet_b0 convnext_tiny vit_b_16 swin_t
#   bash tools/torch-engine-check.sh segment       fcn_resnet50 deeplabv3_resnet50 lraspp_mobilenet_v3_large, with --bench
# or name models (and flags of tools/torch_engine_check.py): bash tools/torch-engine-check.sh swin_t --bench
set -uo pipefail
cd "$(dirname "$0")/.."
export KILN_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib
# PyTorch bundles its own cuDNN and refuses an older one first on the path: only kiln gets KILN_LD.
unset LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$(mktemp -d)}
KILN=${KILN:-.carry/kiln/kiln}
[ -x "$KILN" ] || { echo "no kiln binary at $KILN: run tools/gpu-build.sh first and carry .carry" >&2; exit 2; }
mkdir -p "$OUT/torch-check"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, torchvision; print("torch", torch.__version__, "torchvision", torchvision.__version__, "cudnn", torch.backends.cudnn.version())'
  echo "kiln $(cat .carry/kiln/COMMIT 2>/dev/null || echo '?')"
  date -u
} 2>&1 | tee "$OUT/torch-check/device.log"

case "${1:-all}" in
  classify) shift; set -- resnet50 mobilenet_v3_large efficientnet_b0 convnext_tiny vit_b_16 swin_t "$@" ;;
  segment) shift; set -- fcn_resnet50 deeplabv3_resnet50 lraspp_mobilenet_v3_large --bench "$@" ;;
  all) shift $(($# > 0)); set -- --bench "$@" ;;
esac
python3 tools/torch_engine_check.py --kiln "$KILN" --out "$OUT/torch-check" "$@" 2>&1 | tee "$OUT/torch-check/check.log"
rc=${PIPESTATUS[0]}
# The exported graph files are large (ResNet-50: 100 MB); only the tables and logs come back.
rm -f "$OUT"/torch-check/*.safetensors
exit "$rc"
