#!/usr/bin/env python3
"""Writes `letterbox.reference.safetensors`: Ultralytics' LetterBox (auto=False, scaleup=True,
center=True, pad 114) + BGR->RGB + /255 of random uint8 frames, in numpy, for Kiln's
`yolo_letterbox` op (models/src/yolo_letterbox.rs).

The geometry follows `ultralytics/data/augment.py` LetterBox: r = min(h1/h0, w1/w0),
new_unpad = (round(w0*r), round(h0*r)), dw, dh = (w1 - new_w) / 2, (h1 - new_h) / 2,
top/left = round(d - 0.1), bottom/right = round(d + 0.1). The resize is OpenCV's INTER_LINEAR
rule (half-pixel centres, source coordinate clamped at the edges) computed with f32 weights and
rounded to an integer level; OpenCV itself uses 11-bit fixed-point weights, so it may differ by
one level per pixel. Where OpenCV is installed (`--cv2`), that difference is measured and printed.

Keys: `frame.<case>` [N, H, W * 3] (BGR byte values as f32; RGB for the `rgb_` cases, which
the op reads with `bgr` = 0) and `output.<case>` [N, 3, h1, w1].
"""

import argparse
import os

import numpy as np
import torch
from safetensors.torch import save_file

CASES = {
    # name: (batch, frame h, frame w, model h, model w)
    "wide": (1, 37, 53, 64, 64),
    "tall_nonsquare": (2, 50, 30, 64, 96),
    "same": (1, 64, 64, 64, 64),
    "up": (1, 20, 24, 64, 64),
    "down": (1, 150, 100, 64, 64),
    "odd_pad": (1, 45, 64, 64, 64),
    # RGB frames (the op's `bgr` = 0): the same letterbox, the frame stored R, G, B.
    "rgb_tall_nonsquare": (2, 50, 30, 64, 96),
    "rgb_up": (1, 20, 24, 64, 64),
}


def axis_taps(src, new, dst, before):
    """Per output position (s0, s1, w0, w1) or None in the padding."""
    scale = 1.0 / (new / src)
    taps = []
    for o in range(dst):
        d = o - before
        if d < 0 or d >= new:
            taps.append(None)
            continue
        if new == src:
            taps.append((d, d, np.float32(1), np.float32(0)))
            continue
        f = np.float32((d + 0.5) * scale - 0.5)
        s = np.floor(f)
        s0, w1 = int(s), np.float32(f - s)
        if s0 < 0:
            s0, w1 = 0, np.float32(0)
        if s0 >= src - 1:
            s0, w1 = src - 1, np.float32(0)
        taps.append((s0, min(s0 + 1, src - 1), np.float32(1) - w1, w1))
    return taps


def letterbox(img, new_shape):
    """img: [h, w, 3] uint8 BGR -> [3, h1, w1] float32 RGB / 255."""
    h0, w0 = img.shape[:2]
    h1, w1 = new_shape
    r = min(h1 / h0, w1 / w0)
    new_w, new_h = int(round(w0 * r)), int(round(h0 * r))
    dw, dh = (w1 - new_w) / 2, (h1 - new_h) / 2
    top, left = int(round(dh - 0.1)), int(round(dw - 0.1))
    rows, cols = axis_taps(h0, new_h, h1, top), axis_taps(w0, new_w, w1, left)
    out = np.full((h1, w1, 3), np.float32(114), dtype=np.float32)
    src = img.astype(np.float32)
    for y, ty in enumerate(rows):
        if ty is None:
            continue
        y0, y1, wy0, wy1 = ty
        for x, tx in enumerate(cols):
            if tx is None:
                continue
            x0, x1, wx0, wx1 = tx
            top_ = src[y0, x0] * wx0 + src[y0, x1] * wx1
            bottom = src[y1, x0] * wx0 + src[y1, x1] * wx1
            v = np.rint(top_ * wy0 + bottom * wy1)
            out[y, x] = np.clip(v, 0, 255)
    rgb = out[..., ::-1].transpose(2, 0, 1)
    return (rgb / np.float32(255)).astype(np.float32), (new_w, new_h, top, left)


def cv2_letterbox(img, new_shape):
    import cv2

    h0, w0 = img.shape[:2]
    h1, w1 = new_shape
    r = min(h1 / h0, w1 / w0)
    new_unpad = int(round(w0 * r)), int(round(h0 * r))
    dw, dh = (w1 - new_unpad[0]) / 2, (h1 - new_unpad[1]) / 2
    if (w0, h0) != new_unpad:
        img = cv2.resize(img, new_unpad, interpolation=cv2.INTER_LINEAR)
    top, bottom = int(round(dh - 0.1)), int(round(dh + 0.1))
    left, right = int(round(dw - 0.1)), int(round(dw + 0.1))
    img = cv2.copyMakeBorder(img, top, bottom, left, right, cv2.BORDER_CONSTANT, value=(114, 114, 114))
    return (img[..., ::-1].transpose(2, 0, 1) / 255.0).astype(np.float32)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tests/fixtures")
    p.add_argument("--cv2", action="store_true", help="also measure the difference to OpenCV's letterbox")
    args = p.parse_args()
    rng = np.random.default_rng(3)
    tensors = {}
    for name, (n, h, w, mh, mw) in CASES.items():
        frames = rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)
        outs = []
        for img in frames:
            out, geom = letterbox(img, (mh, mw))
            outs.append(out)
            if args.cv2:
                diff = np.abs(cv2_letterbox(img, (mh, mw)) - out).max() * 255
                print(f"{name}: max difference to OpenCV {diff:.0f} level(s)")
        stored = frames[..., ::-1] if name.startswith("rgb_") else frames
        tensors[f"frame.{name}"] = torch.from_numpy(np.ascontiguousarray(stored).reshape(n, h, w * 3).astype(np.float32))
        tensors[f"output.{name}"] = torch.from_numpy(np.stack(outs))
        print(f"{name}: frame {h}x{w} -> {mh}x{mw}, resized to {geom[0]}x{geom[1]}, padding top {geom[2]} left {geom[3]}")
    path = os.path.join(args.out, "letterbox.reference.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
