#!/usr/bin/env bash
# On a GPU machine: MobileNetV2 with torchvision's ImageNet checkpoint on scikit-image's photos.
# Each photo's top-1 class from FP16 and INT8 engines is compared with the FP32 engine's (TF32 off);
# the INT8 engine is calibrated on the other scikit-image photos, none of which is evaluated.
#
#   PTH=mobilenet_v2-b0353104.pth KILN=target/release/kiln OUT=photo-check-out bash tools/photo-check.sh
#
# PTH comes from tools/fetch_real_data.py; the photos from the installed scikit-image (or PHOTOS=dir).
set -euo pipefail
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-photo-check-out}
PTH=${PTH:?PTH names mobilenet_v2-b0353104.pth (tools/fetch_real_data.py)}
PHOTOS=${PHOTOS:-$(python3 -c 'import os, skimage; print(os.path.join(os.path.dirname(skimage.__file__), "data"))')}
# The twelve photos the CPU tests compare with torchvision (tools/fetch_real_data.py's PHOTOS).
EVAL=(chelsea.png coffee.png astronaut.png rocket.jpg motorcycle_left.png motorcycle_right.png
  hubble_deep_field.jpg retina.jpg ihc.png color.png camera.png horse.png)
# Calibration: every other photo of scikit-image's data folder.
CALIB=(brick.png cell.png chessboard_RGB.png clock_motion.png coins.png grass.png gravel.png logo.png
  microaneurysms.png moon.png page.png phantom.png text.png)
mkdir -p "$OUT/calibration"
for p in "${CALIB[@]}"; do cp "$PHOTOS/$p" "$OUT/calibration/"; done
images=()
for p in "${EVAL[@]}"; do images+=(--image "$PHOTOS/$p"); done

"$KILN" calibrate mobilenet_v2 --weights "$PTH" --data "$OUT/calibration" -o "$OUT/mobilenet_v2.calib.json" 2>&1 | tail -n 3
for precision in fp32 fp16 int8; do
  extra=()
  [[ $precision == int8 ]] && extra=(--calibration-cache "$OUT/mobilenet_v2.calib.json")
  "$KILN" run mobilenet_v2 --weights "$PTH" "${images[@]}" "--$precision" "${extra[@]}" >"$OUT/$precision.txt"
done

python3 - "$OUT" <<'PY'
import re, sys
out = sys.argv[1]
def top1(precision):
    """photo -> (class, name, p) of the first line under each `path: top-5:` header."""
    found, photo = {}, None
    for line in open(f"{out}/{precision}.txt"):
        m = re.match(r"^(\S+): top-\d+:", line)
        if m:
            photo = m.group(1).rsplit("/", 1)[-1]
            continue
        m = re.match(r"^\s+p ([0-9.]+)\s+(.*) \(class (\d+)\)", line)
        if m and photo and photo not in found:
            found[photo] = (int(m.group(3)), m.group(2), float(m.group(1)))
    return found
ref = top1("fp32")
print(f"{'photo':24} {'FP32 top-1':34} {'FP16':34} {'INT8':34}")
agree = {"fp16": 0, "int8": 0}
for photo, (c, name, p) in ref.items():
    row = [f"{name} {p:.3f}"]
    for prec in ("fp16", "int8"):
        oc, oname, op = top1(prec)[photo]
        agree[prec] += oc == c
        row.append(f"{oname} {op:.3f}" + ("" if oc == c else "  (differs)"))
    print(f"{photo:24} " + " ".join(f"{r:34}" for r in row))
n = len(ref)
print(f"top-1 agreement with FP32 over {n} photos: FP16 {agree['fp16']}/{n}, INT8 {agree['int8']}/{n}")
PY
