"""Writes the CI fixtures of kiln-torch: small models built from torchvision's own classes (and one
written with functional calls), exported to Kiln graph files with their PyTorch outputs.

    pip install ./python
    python3 tools/export_imported_fixtures.py --out tests/fixtures/imported

`tests/imported.rs` runs each graph file on the CPU executor against PyTorch, generates structured
code for it (committed in tests/generated/imported/) and runs that code against the graph file.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from import_check import Handwritten  # noqa: E402


def tiny_resnet():
    """torchvision's BasicBlock in two stages of two (the second with a strided downsample)."""
    from torchvision.models.resnet import BasicBlock

    class TinyResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(8)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            down = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2, bias=False), nn.BatchNorm2d(16))
            self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
            self.layer2 = nn.Sequential(BasicBlock(8, 16, stride=2, downsample=down), BasicBlock(16, 16))
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(16, 10)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer2(self.layer1(x))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    return TinyResNet(), [1, 3, 32, 32]


def tiny_mobilenet_v2():
    from torchvision.models import MobileNetV2

    setting = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 2, 2]]
    return MobileNetV2(num_classes=10, width_mult=0.5, inverted_residual_setting=setting), [1, 3, 32, 32]


def tiny_swin():
    """torchvision's Swin (shifted windows merged into the batch, patch merging's strided slices)."""
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer([4, 4], 16, [2, 2], [2, 4], [4, 4], num_classes=10), [1, 3, 32, 32]


def tiny_vit():
    """torchvision's ViT (class token, nn.MultiheadAttention)."""
    from torchvision.models.vision_transformer import VisionTransformer

    m = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10)
    nn.init.normal_(m.heads.head.weight, std=0.2)
    return m, [1, 3, 32, 32]


def tiny_deeplab():
    """torchvision's DeepLabV3 head (its ASPP: dilated convs, image pooling upsampled bilinearly),
    16 channels wide, on a small backbone, upsampled to the input as torchvision's segmentation
    models are."""
    from torchvision.models.segmentation.deeplabv3 import ASPP

    class TinyDeepLab(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = nn.Sequential(
                nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                nn.Conv2d(16, 32, 3, stride=2, padding=2, dilation=2), nn.BatchNorm2d(32), nn.Hardswish(),
            )
            self.classifier = nn.Sequential(
                ASPP(32, [2, 4, 6], out_channels=16), nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                nn.Conv2d(16, 3, 1),
            )

        def forward(self, x):
            y = self.classifier(self.backbone(x))
            return {"out": F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)}

    return TinyDeepLab(), [1, 3, 40, 40]


def tiny_swin_opwise():
    """`tiny_swin` converted op by op (no whole-module converters): windows merged into the batch
    (lifted values), patch merging's strided slices, folded masks; it runs at any batch."""
    return tiny_swin()


OPWISE = {"tiny_swin_opwise"}

MODELS = {
    "tiny_resnet": tiny_resnet,
    "tiny_mobilenet_v2": tiny_mobilenet_v2,
    "handwritten": lambda: (Handwritten(), [1, 3, 64, 64]),
    "tiny_swin": tiny_swin,
    "tiny_swin_opwise": tiny_swin_opwise,
    "tiny_vit": tiny_vit,
    "tiny_deeplab": tiny_deeplab,
}


def randomise_batch_norm(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=gen) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) * 0.5 + 0.75)


def main() -> int:
    import kiln_torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="tests/fixtures/imported")
    p.add_argument("models", nargs="*", default=list(MODELS))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name in a.models:
        torch.manual_seed(0)
        model, shape = MODELS[name]()
        model.eval()
        randomise_batch_norm(model)
        x = torch.rand(shape, generator=torch.Generator().manual_seed(7)) * 2 - 1
        path = os.path.join(a.out, f"{name}.kiln.safetensors")
        ref = os.path.join(a.out, f"{name}.reference.safetensors")
        r = kiln_torch.export(model, (x,), path, input_names=["input"], reference=ref, model_name=name, whole_modules=name not in OPWISE)
        size = os.path.getsize(path) + os.path.getsize(ref)
        print(f"{name}: {sum(r.graph.op_counts().values())} ops, {size / 1024:.0f} KiB, outputs {list(r.outputs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
