#!/usr/bin/env bash
# 8-bit builds and engines on the GPU machine (docs/QUANT.md "Build time"): how long an INT8 and
# an FP8 build of ResNet-50 at batch 256 takes from a cold and from a warm timing cache (with the
# build summary's time line: where the seconds went), and each 8-bit engine's speed against
# another build of the CLI (OLD, e.g. the previous release) on the same calibration cache.
#
#   bash tools/gpu-build.sh   # here; then on the device:
#   KILN=.carry/kiln/kiln OLD=.carry/kiln/kiln-old bash tools/quant-speed-check.sh
#
# MODELS (default "resnet50 mobilenet_v2"), BATCHES (default "1 256"), PRECISIONS (default
# "int8 fp8"). Results under $OUT: build.log, bench.log and one JSON record per bench.
set -uo pipefail
# Binaries staged compressed (tools/gpu-build.sh XZ=1) are decompressed first.
[ -f tools/carry-unpack.sh ] && source tools/carry-unpack.sh
KILN=${KILN:-target/release/kiln}
OLD=${OLD:-}
OUT=${OUT:-$(mktemp -d)}
export LD_LIBRARY_PATH=${KILN_LD:-/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib}
WORK=$(mktemp -d /tmp/kiln-quant-speed.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"

# A calibration input: 16 images of uniform noise in the normalised range, written as safetensors
# without NumPy (the machine's python3 may lack it).
python3 - "$WORK/calib.safetensors" <<'PY'
import json, random, struct, sys
n = 16 * 3 * 224 * 224
rng = random.Random(0)
data = struct.pack(f"<{n}f", *(rng.uniform(-2.0, 2.0) for _ in range(n)))
header = json.dumps({"input": {"dtype": "F32", "shape": [16, 3, 224, 224], "data_offsets": [0, len(data)]}}).encode()
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + data)
PY

for m in ${MODELS:-resnet50 mobilenet_v2}; do
  # Each build of the CLI calibrates for itself (cache versions may differ between them).
  "$KILN" calibrate "$m" --data "$WORK/calib.safetensors" -o "$WORK/$m.calib.json" -q || { echo "CALIBRATE FAILED: $m"; continue; }
  [[ -n $OLD ]] && { "$OLD" calibrate "$m" --data "$WORK/calib.safetensors" -o "$WORK/$m.old.calib.json" -q || echo "CALIBRATE FAILED (old): $m"; }
  for p in ${PRECISIONS:-int8 fp8}; do
    # Build time at the largest batch: cold, then warm from the timing cache the cold build wrote.
    big=$(echo ${BATCHES:-1 256} | tr ' ' '\n' | sort -n | tail -1)
    for cache in cold warm; do
      [[ $cache == cold ]] && rm -f "$WORK/$m.$p.tc.json"
      t0=$(date +%s.%N)
      "$KILN" build "$m" --"$p" --calibration-cache "$WORK/$m.calib.json" --opt-batch "$big" --max-batch "$big" \
        --timing-cache "$WORK/$m.$p.tc.json" -o "$WORK/$m.$p.kiln" >"$WORK/build.txt" 2>&1
      rc=$?
      t1=$(date +%s.%N)
      echo "BUILD $m $p batch $big ($cache timing cache): exit $rc, $(python3 -c "print(f'{$t1 - $t0:.1f}')") s" | tee -a "$OUT/build.log"
      grep -E "^build time|tactics timed|error" "$WORK/build.txt" | tee -a "$OUT/build.log"
    done
    for b in ${BATCHES:-1 256}; do
      for k in new old; do
        bin=$KILN cache=$WORK/$m.calib.json
        [[ $k == old ]] && bin=$OLD cache=$WORK/$m.old.calib.json
        [[ -z $bin ]] && continue
        "$bin" bench "$m" --"$p" --calibration-cache "$cache" --batch "$b" --cuda-graphs-only \
          --json "$OUT/bench_${m}_${p}_b${b}_$k.json" >"$WORK/bench.txt" 2>&1 || echo "BENCH FAILED: $k $m $p $b" | tee -a "$OUT/bench.log"
        echo "BENCH $k $m $p batch $b: $(grep -E 'median|throughput' "$WORK/bench.txt" | tr '\n' ' ')" | tee -a "$OUT/bench.log"
      done
    done
  done
done
