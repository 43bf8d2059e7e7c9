#!/usr/bin/env bash
# Runs on the device (after tools/gpu-build.sh, or `cargo build --release -p kiln-cli` with the binary
# stripped into .carry/kiln/kiln, here): issue 38 item 4's engine check. tools/pt2e_check.py
# quantises ResNet-18 and the trained MobileNetV2 with PyTorch's PT2E flow (torchao from .whl/),
# exports them with kiln-torch, and runs each graph on Kiln's CPU simulation and in an INT8 engine
# built from its own Q/DQ nodes, against PyTorch's quantised model and against each other.
#
#   here:    cargo build --release -p kiln-cli && mkdir -p .carry/kiln .carry/real-data .whl \
#              && cp target/release/kiln .carry/kiln/ && strip .carry/kiln/kiln \
#              && cp -r <real-data>/photos <real-data>/mobilenet_v2-*.pth .carry/real-data/ \
#              && pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                   --platform manylinux2014_x86_64 -d .whl torchao==0.18.0
#   device:  bash tools/pt2e-gpu-check.sh        carry [".carry", ".whl"], timeout_s 600
#
# Arguments go to tools/pt2e_check.py (default: --models resnet18,mobilenet_v2:trained,fake_quant_net).
# Results in $OUT/pt2e: check.log (the tables), rows.json, device.log.
set -uo pipefail
cd "$(dirname "$0")/.."
# Binaries staged compressed (tools/gpu-build.sh XZ=1) are decompressed first.
[ -f tools/carry-unpack.sh ] && source tools/carry-unpack.sh
export KILN_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib
# PyTorch bundles its own cuDNN and refuses an older one first on the path: only kiln gets KILN_LD.
unset LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kiln-pt2e-site .whl/torchao-*.whl
export PYTHONPATH=$PWD/python:/tmp/kiln-pt2e-site
export KILN_REAL_DATA=${KILN_REAL_DATA:-$PWD/.carry/real-data}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT/pt2e"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, torchvision, torchao; print("torch", torch.__version__, "torchvision", torchvision.__version__, "torchao", torchao.__version__)'
  git log -1 --format='kiln %h' 2>/dev/null
  date -u
} 2>&1 | tee "$OUT/pt2e/device.log"
[ $# -eq 0 ] && set -- --models resnet18,mobilenet_v2:trained,fake_quant_net
python3 tools/pt2e_check.py --kiln .carry/kiln/kiln --out "$OUT/pt2e/work" --engine --json "$OUT/pt2e/rows.json" "$@" 2>&1 \
  | tee "$OUT/pt2e/check.log"
status=${PIPESTATUS[0]}
rm -rf "$OUT/pt2e/work"
exit "$status"
