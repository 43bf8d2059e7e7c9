#!/usr/bin/env python3
"""Trains Kiln's digits ResNet (`digits_resnet` in kiln-models) on scikit-learn's bundled
`load_digits` (1,797 8x8 images of 0..16): each image is upsampled to 32x32 (bilinear), mapped to
[-1, 1] and repeated over 3 channels; 30% are held out (stratified, fixed seed). CPU, fixed seeds,
about a minute.

Writes (small enough to commit):
  models/weights/digits_resnet.safetensors     the state_dict (torchvision BasicBlock names)
  tests/fixtures/digits.safetensors            `heldout` [N, 1, 32, 32] f16 with `heldout_labels`,
                                               and `calib` [100, 1, 32, 32] f16 (training images)
Inputs are rounded to f16 before training and evaluation, so the stored images are exactly the
ones PyTorch's accuracy was measured on (repeat the channel 3 times to feed the model).

    pip install scikit-learn && python3 tools/train_digits.py
"""

import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torchvision.models.resnet import BasicBlock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def block(cin, cout, stride):
    down = None
    if stride != 1 or cin != cout:
        down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
    return nn.Sequential(BasicBlock(cin, cout, stride, downsample=down))


class DigitsResNet(nn.Module):
    """A small ResNet: a 3x3 stem and three BasicBlock stages (16, 32, 64 channels), torchvision's
    names, so `models/src/digits.rs` mirrors it line by line."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = block(16, 16, 1)
        self.layer2 = block(16, 32, 2)
        self.layer3 = block(32, 64, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def images(raw):
    """8x8 pixels in 0..16 -> [N, 1, 32, 32] in [-1, 1], rounded to f16."""
    x = torch.from_numpy(raw.astype(np.float32)).view(-1, 1, 8, 8) / 16.0
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    return (x * 2 - 1).half().float()


def rgb(x):
    return x.expand(-1, 3, -1, -1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(2)

    # scikit-learn only here, so tools/export_reference.py can import the model without it.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    tr_x, te_x, tr_y, te_y = train_test_split(d.data, d.target, test_size=0.3, random_state=args.seed, stratify=d.target)
    xtr, xte = images(tr_x), images(te_x)
    ytr, yte = torch.from_numpy(tr_y).long(), torch.from_numpy(te_y).long()

    model = DigitsResNet()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    steps = args.epochs * ((len(xtr) + 63) // 64)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.time()
    for epoch in range(args.epochs):
        model.train()
        perm = torch.randperm(len(xtr), generator=gen)
        total = 0.0
        for i in range(0, len(xtr), 64):
            idx = perm[i : i + 64]
            # Small random shifts (up to 2 pixels) as augmentation.
            dx, dy = torch.randint(-2, 3, (2,), generator=gen).tolist()
            xb = torch.roll(xtr[idx], shifts=(dy, dx), dims=(2, 3))
            loss = F.cross_entropy(model(rgb(xb)), ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        model.eval()
        with torch.no_grad():
            acc = (model(rgb(xte)).argmax(1) == yte).float().mean().item() * 100
        print(f"epoch {epoch + 1}: loss {total / len(xtr):.4f}, held-out top-1 {acc:.2f}% ({time.time() - start:.0f} s)")

    model.eval()
    with torch.no_grad():
        acc = (model(rgb(xte)).argmax(1) == yte).float().mean().item() * 100
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    wpath = os.path.join(ROOT, "models", "weights", "digits_resnet.safetensors")
    os.makedirs(os.path.dirname(wpath), exist_ok=True)
    save_file(sd, wpath)
    fpath = os.path.join(ROOT, "tests", "fixtures", "digits.safetensors")
    save_file(
        {
            "heldout": xte.half().contiguous(),
            "heldout_labels": yte.float().contiguous(),
            "calib": xtr[:100].half().contiguous(),
        },
        fpath,
        metadata={"pytorch_fp32_top1": f"{acc:.4f}"},
    )
    n = sum(v.numel() for v in sd.values())
    print(f"PyTorch FP32 held-out top-1 {acc:.2f}% on {len(xte)} images; {n} parameters ({n * 4 / 1e6:.2f} MB)")
    print(f"wrote {wpath} and {fpath}")


if __name__ == "__main__":
    main()
