#!/usr/bin/env python3
"""Writes `classify_preset.reference.safetensors`: torchvision's classification preset on random
uint8 RGB frames, for Kiln's `classify_preset` op (models/src/classify_preset.rs) and
kiln-vision's `ClassifyPreset`. The reference is the preset a torchvision classifier's
`weights.transforms()` applies to a PIL image, `torchvision.transforms._presets.ImageClassification`:

    F.resize(pil, [resize], InterpolationMode.BILINEAR, antialias=True)   # PIL's Image.resize
    F.center_crop(img, [crop_h, crop_w])
    F.convert_image_dtype(F.pil_to_tensor(img), torch.float)             # / 255 in f32
    F.normalize(x, mean=IMAGENET_MEAN, std=IMAGENET_STD)                  # (x - mean) / std in f32

Two neighbours are measured and printed, not stored: the same steps with
torchvision.transforms.v2.functional (the same levels; its `to_dtype(scale=True)` multiplies by
1/255 where the preset divides, a few ulps), and v2 on a uint8 *tensor* (torchvision's own
antialiased kernel, 16-bit weights, which may differ from PIL by a level here and there).

Keys: `frame.<case>` [N, H, W * 3] (RGB byte values as f32), `preset.<case>` [3] (resize, crop_h,
crop_w) and `output.<case>` [N, 3, crop_h, crop_w].

Run: /work/venv-torch/bin/python tools/classify_preset_reference.py --out tests/fixtures
"""

import argparse
import os

import numpy as np
import torch
import torchvision.transforms.functional as F1
import torchvision.transforms.v2.functional as F
from PIL import Image
from safetensors.torch import save_file
from torchvision.transforms import InterpolationMode
from torchvision.transforms._presets import ImageClassification

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

CASES = {
    # name: (batch, frame h, frame w, resize, crop h, crop w)
    "down": (1, 64, 80, 32, 32, 32),
    "up": (1, 20, 30, 32, 28, 28),
    "tall_nonsquare": (2, 50, 30, 24, 24, 20),
    "same": (1, 32, 40, 32, 32, 32),
    "pad": (1, 16, 16, 12, 16, 14),
    "strong_down": (1, 96, 61, 16, 16, 16),
}


def weights_preset(pil, resize, crop):
    """`ImageClassification.forward`'s steps, with a (crop_h, crop_w) crop (the class takes one size)."""
    x = F1.resize(pil, [resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
    x = F1.center_crop(x, list(crop))
    x = F1.convert_image_dtype(F1.pil_to_tensor(x), torch.float)
    out = F1.normalize(x, mean=MEAN, std=STD)
    if crop[0] == crop[1]:
        assert torch.equal(out, ImageClassification(crop_size=crop[0], resize_size=resize)(pil))
    return out


def v2_preset(img, resize, crop):
    """The preset's steps in torchvision.transforms.v2.functional, on a PIL image or a uint8 tensor."""
    x = F.resize(img, [resize], interpolation=InterpolationMode.BILINEAR, antialias=True)
    x = F.center_crop(x, list(crop))
    if isinstance(x, Image.Image):
        x = F.pil_to_tensor(x)
    x = F.to_dtype(x, torch.float32, scale=True)
    return F.normalize(x, mean=MEAN, std=STD)


def levels(x):
    """Normalised planes back to levels, for measuring differences in levels."""
    return x * torch.tensor(STD)[:, None, None] * 255


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tests/fixtures")
    args = p.parse_args()
    rng = np.random.default_rng(27)
    tensors = {}
    for name, (n, h, w, resize, ch, cw) in CASES.items():
        frames = rng.integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)
        outs, v2_abs, tensor_levels = [], 0.0, 0.0
        for img in frames:
            pil = Image.fromarray(img)
            out = weights_preset(pil, resize, (ch, cw))
            v2 = v2_preset(pil, resize, (ch, cw))
            v2_abs = max(v2_abs, (out - v2).abs().max().item())
            as_tensor = v2_preset(torch.from_numpy(img).permute(2, 0, 1).contiguous(), resize, (ch, cw))
            tensor_levels = max(tensor_levels, (levels(out) - levels(as_tensor)).abs().max().item())
            outs.append(out)
        tensors[f"frame.{name}"] = torch.from_numpy(frames.reshape(n, h, w * 3).astype(np.float32))
        tensors[f"preset.{name}"] = torch.tensor([resize, ch, cw], dtype=torch.float32)
        tensors[f"output.{name}"] = torch.stack(outs)
        print(f"{name}: {n} frame(s) {h}x{w} -> Resize({resize}) -> CenterCrop({ch}, {cw}); v2 on PIL: max abs "
              f"{v2_abs:.1e}; v2 on a uint8 tensor: up to {tensor_levels:.0f} level(s) from PIL's")
    path = os.path.join(args.out, "classify_preset.reference.safetensors")
    save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
