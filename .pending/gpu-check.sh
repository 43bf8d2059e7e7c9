#!/usr/bin/env bash
# The parked series' first GPU call (run on the device from the repository root; `.carry` staged
# here after `git am .pending/*/*.patch` by `XZ=1 bash tools/gpu-build.sh`). Each step runs under
# `timeout`, since a hung persistent kernel is the first risk; logs under $OUT/logs, tarred.
set -uo pipefail
source tools/carry-unpack.sh
KILN_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib
unset LD_LIBRARY_PATH
export KILN_FIXTURES=$PWD/tests/fixtures
L=$OUT/logs; mkdir -p "$L"
step() { local name=$1 limit=$2; shift 2; echo "=== $name $(date +%T)" | tee -a "$L/steps.log"; timeout "$limit" "$@" > "$L/$name.log" 2>&1; echo "=== $name rc $? $(date +%T)" | tee -a "$L/steps.log"; }
t() { env LD_LIBRARY_PATH=$KILN_LD ".carry/bin/$1" --include-ignored --nocapture --test-threads 1 "${@:2}"; }
# A fresh cache folder: the first build pays NVRTC (the depthwise parts side by side).
export KILN_CACHE_DIR=/tmp/kiln-cache-fresh
step conv8hopper 150 t gpu_conv8_hopper
step depthwise 120 t gpu_depthwise
step kernels 120 t gpu_kernels
step memcheck 150 env CONV8_HOPPER_SOURCE=n128_bk64_s8 LD_LIBRARY_PATH=$KILN_LD compute-sanitizer --tool memcheck --report-api-errors no \
  --kernel-regex kns=_wgmma_ .carry/bin/gpu_conv8_hopper --include-ignored --nocapture --test-threads 1
step racecheck 150 env CONV8_HOPPER_SOURCE=n64_bk64_s8 LD_LIBRARY_PATH=$KILN_LD compute-sanitizer --tool racecheck --racecheck-report all \
  --report-api-errors no --kernel-regex kns=_wgmma_ .carry/bin/gpu_conv8_hopper --include-ignored --nocapture --test-threads 1
# Speed: ResNet-50 INT8 at batch 256, per layer (does timing pick the wgmma conv now?) and whole.
K=.carry/kiln/kiln
python3 - /tmp/calib.safetensors <<'PY'
import json, random, struct, sys
n = 16 * 3 * 224 * 224
rng = random.Random(0)
data = struct.pack(f"<{n}f", *(rng.uniform(-2.0, 2.0) for _ in range(n)))
header = json.dumps({"input": {"dtype": "F32", "shape": [16, 3, 224, 224], "data_offsets": [0, len(data)]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header + data)
PY
LD_LIBRARY_PATH=$KILN_LD $K calibrate resnet50 --data /tmp/calib.safetensors -o /tmp/c.json -q > "$L/calib.log" 2>&1
step profile 150 env LD_LIBRARY_PATH=$KILN_LD $K profile resnet50 --int8 --calibration-cache /tmp/c.json --batch 256
step bench 120 env LD_LIBRARY_PATH=$KILN_LD $K bench resnet50 --int8 --calibration-cache /tmp/c.json --batch 1,256 --cuda-graphs-only
cd "$L" && tar czf "$OUT/all.tgz" ./*.log
