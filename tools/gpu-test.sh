#!/usr/bin/env bash
# Runs on the device (after tools/gpu-build.sh here): exports PyTorch references with the project's
# own script (seeded weights and torchvision's random init), runs every carried GPU test binary and,
# with PEERS=1, the PyTorch peers. Logs go to $OUT (the device tool brings them back).
#
#   device run:  bash tools/gpu-test.sh          carry: [".carry"]
#
# The whole suite takes about 15 minutes on an H100 (INT8/FP8 builds time cuDNN's fused plans;
# gpu_quant alone about 6.5), more than one device call's 10: run it in two calls, e.g.
#   BINS="gpu_quant gpu_resize gpu_shape gpu_yolo" bash tools/gpu-test.sh
# and the other binaries with SKIP_BINS set to the same list. Exports not needed can be cut with
# MODELS=..., WEIGHTS=..., SHAPES=... (gpu_quant needs `resnet50` with `torchvision` weights).
set -uo pipefail
# Binaries staged compressed (tools/gpu-build.sh XZ=1) are decompressed first.
[ -f tools/carry-unpack.sh ] && source tools/carry-unpack.sh
# Kiln's binaries need the system cuDNN 9.14 and CUDA 13 libraries; PyTorch must not see them (it
# bundles cuDNN 9.19 and refuses an older one first on the path), so only the binaries get this.
KILN_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib
unset LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export KILN_FIXTURES=$PWD/tests/fixtures
# A reference folder kept between calls on one machine (REF=/tmp/kiln-ref) is exported once: the
# second call of a suite split in two skips the exports.
REF=${REF:-$(mktemp -d)}
mkdir -p "$REF"
export KILN_REFERENCE_DIR=$REF
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())'
  date -u
} 2>&1 | tee "$OUT/device.log"

# References: the models' PyTorch twins on this machine, FP32 with TF32 off.
t0=$(date +%s)
if [ -f "$REF/.exported" ]; then MODELS=" " ZOO=" " SHAPES=" "; echo "references already in $REF" | tee "$OUT/export.log"; fi
for w in ${WEIGHTS:-seeded torchvision}; do
  for m in ${MODELS:-resnet18 resnet50 centernet}; do
    python3 .carry/tools/export_reference.py --model "$m" --weights "$w" --seed 0 --save-weights --out "$REF/$w" || echo "EXPORT FAILED: $m $w"
  done
done 2>&1 | tee "$OUT/export.log"
# The rest of the zoo against torchvision's own models (random init), batch 1 at 224.
for m in ${ZOO:-}; do
  python3 .carry/tools/export_reference.py --model "$m" --weights torchvision --seed 0 --save-weights --out "$REF/torchvision" || echo "EXPORT FAILED: $m"
done 2>&1 | tee -a "$OUT/export.log"
# CenterNet at the sizes one engine with an H/W profile runs (tests/gpu_profiles.rs).
for s in ${SHAPES:-384x512 512x512 640x480}; do
  python3 .carry/tools/export_reference.py --model centernet --weights seeded --seed 0 --size "$s" --out "$REF/shapes/$s" || echo "EXPORT FAILED: centernet $s"
done 2>&1 | tee -a "$OUT/export.log"
echo "references exported in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/export.log"
touch "$REF/.exported"

status=0
for t in .carry/bin/*; do
  name=$(basename "$t")
  if [ -n "${BINS:-}" ] && [[ " $BINS " != *" $name "* ]]; then continue; fi
  if [[ " ${SKIP_BINS:-} " == *" $name "* ]]; then continue; fi
  echo "=== $name" | tee -a "$OUT/tests.log"
  # GPU tests are #[ignore]d so that CI without a GPU reports them as ignored, not passed.
  LD_LIBRARY_PATH=$KILN_LD "$t" --include-ignored --nocapture --test-threads 1 ${TEST_FILTER:-} 2>&1 | tee -a "$OUT/tests.log" || status=1
done
grep -E "^TIMING" "$OUT/tests.log" > "$OUT/timings.log" || true

if [ "${PEERS:-0}" = 1 ]; then
  EAGER=1 COMPILE=${COMPILE:-0} python3 .carry/tools/torch_peer.py 2>&1 | tee "$OUT/torch_peer.log"
fi
echo "exit status $status"
exit $status
