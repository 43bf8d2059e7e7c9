#!/usr/bin/env python3
"""torchvision's own answers on the real photos, for vision/tests/real_photos.rs: torchvision's
`mobilenet_v2` with the real checkpoint and its own `MobileNet_V2_Weights.IMAGENET1K_V1`
transforms, on PIL images (`Image.open(p).convert("RGB")`), in f32 on the CPU.

Reads the folder of tools/fetch_real_data.py (default target/real-data). Writes
  vision/tests/fixtures/photos.reference.safetensors   committed: `logits.<photo>` [1000] f32;
      metadata: versions, the checkpoint's SHA-256, per photo its top-5 (`top5.<photo>`), the
      SHA-256 of its decoded RGB pixels (`decoded_sha256.<photo>`) and of its 224x224 RGB crop
      after PIL's resize and the centre crop (`crop_sha256.<photo>`; wherever Kiln decodes the
      same pixels, its preprocessing must give this crop bit for bit)
  DEST/torchvision_inputs.safetensors                  not committed: `pil.<photo>` (the model
      input torchvision made) and `tensor.<photo>` (the same transforms on the decoded uint8
      tensor instead of the PIL image: torch's own antialiased resize), for measurements

    /path/to/venv-with-torch/bin/python tools/export_photo_reference.py [--data DEST]
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np
import torch
import torchvision
import torchvision.transforms.functional as F
from PIL import Image
from safetensors.torch import save_file
from torchvision.models import MobileNet_V2_Weights, mobilenet_v2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from fetch_real_data import CHECKPOINT, PHOTOS, sha256  # noqa: E402

OUT = os.path.join(ROOT, "vision", "tests", "fixtures", "photos.reference.safetensors")


def rel_l2(a, b):
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=os.path.join(ROOT, "target", "real-data"))
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() // 2))
    weights = MobileNet_V2_Weights.IMAGENET1K_V1
    preprocess = weights.transforms()
    model = mobilenet_v2()
    checkpoint = os.path.join(args.data, CHECKPOINT)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True), strict=True)
    model.eval()
    names = weights.meta["categories"]

    tensors, inputs = {}, {}
    meta = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "checkpoint": CHECKPOINT,
        "checkpoint_sha256": sha256(checkpoint),
        "transforms": repr(preprocess).replace("\n", " "),
        "photos": json.dumps(PHOTOS),
    }
    for photo in PHOTOS:
        img = Image.open(os.path.join(args.data, "photos", photo)).convert("RGB")
        x = preprocess(img)
        # The same steps one by one: the crop Kiln must reproduce, then to_tensor and normalise.
        crop = F.center_crop(F.resize(img, [256], interpolation=F.InterpolationMode.BILINEAR), [224])
        crop_bytes = np.asarray(crop, dtype=np.uint8).tobytes()
        steps = F.normalize(F.convert_image_dtype(F.pil_to_tensor(crop), torch.float), weights.transforms().mean, weights.transforms().std)
        assert torch.equal(steps, x), photo
        # The tensor path: the same transforms on the decoded uint8 tensor (torch's antialiased resize).
        xt = preprocess(F.pil_to_tensor(img))
        with torch.no_grad():
            logits = model(torch.stack([x, xt]))
        top5 = logits[0].topk(5).indices.tolist()
        p = logits[0].softmax(0)
        tensors[f"logits.{photo}"] = logits[0].contiguous()
        inputs[f"pil.{photo}"] = x.unsqueeze(0).contiguous()
        inputs[f"tensor.{photo}"] = xt.unsqueeze(0).contiguous()
        meta[f"top5.{photo}"] = ",".join(map(str, top5))
        meta[f"crop_sha256.{photo}"] = hashlib.sha256(crop_bytes).hexdigest()
        meta[f"decoded_sha256.{photo}"] = hashlib.sha256(np.asarray(img, dtype=np.uint8).tobytes()).hexdigest()
        meta[f"tensor_path_rel_l2.{photo}"] = f"{rel_l2(logits[1], logits[0]):.3e}"
        print(
            f"{photo:24s} {names[top5[0]]!r} p {float(p[top5[0]]):.3f}; top-5 {top5}; "
            f"PIL vs tensor resize: input max |d| {float((x - xt).abs().max()):.3f}, logits rel L2 {rel_l2(logits[1], logits[0]):.2e}"
        )
    save_file(tensors, OUT, metadata=meta)
    save_file(inputs, os.path.join(args.data, "torchvision_inputs.safetensors"))
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
