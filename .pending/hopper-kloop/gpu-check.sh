#!/usr/bin/env bash
# The parked series' GPU call, run on the device from the repository root after, here:
#   git am .pending/hopper-kloop/*.patch
#   cargo test --release -p kiln --test gpu_conv8_hopper --no-run; cargo build --release -p kiln-cli
#   stage the test binary (stripped, xz) as .carry/bin/gpu_conv8_hopper.xz and `XZ=1 bash tools/stage-cli.sh`
# then the device tool with carry [".carry"]. Each step under `timeout`; logs tarred after each.
set -uo pipefail
source tools/carry-unpack.sh
KILN_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib
unset LD_LIBRARY_PATH
export KILN_FIXTURES=$PWD/tests/fixtures
L=$OUT/logs; mkdir -p "$L"
step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name $(date +%T)" | tee -a "$L/steps.log"
  timeout "$limit" env LD_LIBRARY_PATH=$KILN_LD "$@" > "$L/$name.log" 2>&1
  echo "=== $name rc $? $(date +%T)" | tee -a "$L/steps.log"
  (cd "$L" && tar czf "$OUT/all.tgz" ./*.log ./*.csv 2>/dev/null)
}
B=.carry/bin/gpu_conv8_hopper; K=.carry/kiln/kiln
T=(--include-ignored --nocapture --test-threads 1)
S=(--report-api-errors no --kernel-regex kns=_wgmma_)
step conv8hopper 120 $B "${T[@]}"
step memcheck 120 env CONV8_HOPPER_SOURCE=n128_bk64_s8 CONV8_HOPPER_BATCHES=1,7 compute-sanitizer --tool memcheck "${S[@]}" $B "${T[@]}"
step racecheck 120 env CONV8_HOPPER_SOURCE=n64_bk64_s8 CONV8_HOPPER_BATCHES=1 compute-sanitizer --tool racecheck --racecheck-report hazard "${S[@]}" $B "${T[@]}" wgmma_conv8_at_the_edges
step synccheck 90 env CONV8_HOPPER_SOURCE=n128_bk64_s8 CONV8_HOPPER_BATCHES=1 compute-sanitizer --tool synccheck "${S[@]}" $B "${T[@]}" wgmma_conv8_at_the_edges
python3 - /tmp/calib.safetensors <<'PY'
import json, random, struct, sys
n = 16 * 3 * 224 * 224
rng = random.Random(0)
data = struct.pack(f"<{n}f", *(rng.uniform(-2.0, 2.0) for _ in range(n)))
header = json.dumps({"input": {"dtype": "F32", "shape": [16, 3, 224, 224], "data_offsets": [0, len(data)]}}).encode()
open(sys.argv[1], "wb").write(struct.pack("<Q", len(header)) + header + data)
PY
env LD_LIBRARY_PATH=$KILN_LD $K calibrate resnet50 --data /tmp/calib.safetensors -o /tmp/c.json -q > "$L/calib.log" 2>&1
C=(resnet50 --int8 --calibration-cache /tmp/c.json)
step profile_wgmma 90 $K profile "${C[@]}" --batch 256 --tactic-sources kernel:conv8_i8_wgmma
step profile 90 $K profile "${C[@]}" --batch 256
step bench 90 $K bench "${C[@]}" --batch 1,256 --cuda-graphs-only
step build_n64 60 $K build "${C[@]}" --max-batch 256 --tactic-sources kernel:conv8_i8_wgmma_n64_bk64_s8 -o /tmp/rw.kiln
step ncu 60 ncu --kernel-name regex:wgmma --launch-skip 1 --launch-count 1 --set full --import-source no -o /tmp/rep $K run /tmp/rw.kiln --shapes input:256x3x224x224
env LD_LIBRARY_PATH=$KILN_LD ncu -i /tmp/rep.ncu-rep --page source --csv --print-source sass > "$L/ncu_sass.csv" 2>&1
(cd "$L" && tar czf "$OUT/all.tgz" ./*.log ./*.csv 2>/dev/null)
