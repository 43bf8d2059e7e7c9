#!/usr/bin/env bash
# On a GPU machine: the image entry stages (issue 27) end to end.
#  1. their GPU tests: tests/gpu_classify_preset.rs (torchvision's classifier preset from u8 frames
#     against its CPU reference at 8 frame sizes, RGB and BGR, FP32 exact, FP16 <= 1e-3; MobileNetV2
#     behind it) and tests/gpu_yolo.rs's letterbox tests (BGR and RGB frames);
#  2. examples/classify --gpu-entry on real photos: the top-5 of an FP16 engine whose first layer is
#     the preset (classify_preset, fed the photo's decoded bytes) against the top-5 of the same
#     model on kiln-vision's CPU preset, with the logits' rel L2;
#  3. examples/detect with and without --gpu-entry on one photo (the letterbox of RGB frames and
#     the NMS in frame pixels inside the engine); seeded weights unless YOLO_WEIGHTS is given;
#  4. `kiln build mobilenet_v2 --frames 480x640` and examples/embed serving that engine file.
#
#   PTH=mobilenet_v2-b0353104.pth PHOTOS=photos/ OUT=entry-check-out bash tools/entry-check.sh
#
# Defaults: PTH=target/real-data/mobilenet_v2-b0353104.pth, PHOTOS=target/real-data/photos
# (tools/fetch_real_data.py writes both), OUT=entry-check-out, KILN=target/release/kiln.
# SKIP_TESTS=1 skips step 1; YOLO_WEIGHTS=yolov8n.safetensors gives step 3 real weights. Without a
# GPU, steps 2 and 3 run on the CPU executor and step 4 fails (an engine needs a GPU).
set -euo pipefail
PTH=${PTH:-target/real-data/mobilenet_v2-b0353104.pth}
PHOTOS=${PHOTOS:-target/real-data/photos}
OUT=${OUT:-entry-check-out}
KILN=${KILN:-target/release/kiln}
EXAMPLES=${EXAMPLES:-target/release/examples}
# The twelve photos the CPU tests compare with torchvision (PHOTO_LIST="a.png b.jpg" picks others).
# (One line: `read` stops at the first newline.)
DEFAULT_PHOTOS="chelsea.png coffee.png astronaut.png rocket.jpg motorcycle_left.png motorcycle_right.png hubble_deep_field.jpg retina.jpg ihc.png color.png camera.png horse.png"
read -ra EVAL <<<"${PHOTO_LIST:-$DEFAULT_PHOTOS}"
[[ -f $PTH ]] || { echo "PTH=$PTH: no such checkpoint (tools/fetch_real_data.py)" >&2; exit 2; }
[[ -d $PHOTOS ]] || { echo "PHOTOS=$PHOTOS: no such folder" >&2; exit 2; }
mkdir -p "$OUT"

echo "== 1. GPU tests of the entry stages"
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  cargo test --release -p kiln --test gpu_classify_preset --test gpu_yolo -- --include-ignored --nocapture classif letterbox \
    2>&1 | tee "$OUT/gpu-tests.txt" | grep -E "^(classify_preset|mobilenet_v2|letterbox)|^test |test result" ||
    echo "GPU tests FAILED: see $OUT/gpu-tests.txt"
fi
cargo build --release --examples -p kiln 2>&1 | tail -n 1
cargo build --release -p kiln-cli 2>&1 | tail -n 1

echo "== 2. classify: the preset on the GPU (classify_preset) vs kiln-vision's CPU preset, FP16 engines"
same=0 total=0
for p in "${EVAL[@]}"; do
  [[ -f $PHOTOS/$p ]] || { echo "skipped $p: not in $PHOTOS"; continue; }
  "$EXAMPLES/classify" "$PHOTOS/$p" --weights "$PTH" --gpu-entry | tee "$OUT/classify-$p.txt"
  total=$((total + 1))
  grep -q "top-5 identical" "$OUT/classify-$p.txt" && same=$((same + 1))
done
echo "top-5 identical (GPU entry stage vs CPU preset) on $same of $total photos"

echo "== 3. detect: host letterbox vs the letterbox inside the engine"
yolo=()
[[ -n ${YOLO_WEIGHTS:-} ]] && yolo=(--weights "$YOLO_WEIGHTS")
for mode in host gpu-entry; do
  flag=()
  [[ $mode == gpu-entry ]] && flag=(--gpu-entry)
  "$EXAMPLES/detect" "$PHOTOS/motorcycle_left.png" "${yolo[@]}" "${flag[@]}" -o "$OUT/detect-$mode.png" >"$OUT/detect-$mode.txt"
  head -n 6 "$OUT/detect-$mode.txt"
done
if cmp -s <(tail -n +2 "$OUT/detect-host.txt" | grep -v '^wrote') <(tail -n +2 "$OUT/detect-gpu-entry.txt" | grep -v '^wrote'); then
  echo "detect: the same boxes from both"
else
  echo "detect: the boxes differ (FP16 engines of different graphs; compare $OUT/detect-*.txt)"
fi

echo "== 4. an engine file behind the entry stage, served from 4 threads"
"$KILN" build mobilenet_v2 --weights "$PTH" --frames 480x640 --fp16 -o "$OUT/mobilenet_v2-frames.kiln" 2>&1 | tail -n 2
"$EXAMPLES/embed" "$OUT/mobilenet_v2-frames.kiln" --threads 4 --requests 64
