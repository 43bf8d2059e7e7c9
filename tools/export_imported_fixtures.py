"""Writes the CI fixtures of kiln-torch: small models built from torchvision's own classes (and one
written with functional calls), exported to Kiln graph files with their PyTorch outputs.

    pip install ./python ultralytics       # Ultralytics for tiny_yolov8 alone
    YOLO_OFFLINE=1 python3 tools/export_imported_fixtures.py --out tests/fixtures/imported [NAME...]

`tests/imported.rs` runs each graph file on the CPU executor against PyTorch, generates structured
code for it (committed in tests/generated/imported/) and runs that code against the graph file.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

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


def tiny_lraspp():
    """torchvision's LR-ASPP head (a sigmoid gate from image pooling, two bilinear upsamplings) on
    MobileNetV3 blocks (squeeze-excitation with hardsigmoid, hardswish)."""
    from torchvision.models.mobilenetv3 import InvertedResidual, InvertedResidualConfig
    from torchvision.models.segmentation.lraspp import LRASPPHead
    from torchvision.ops.misc import Conv2dNormActivation

    norm = partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
    cfg = partial(InvertedResidualConfig, width_mult=1.0)

    class TinyLRASPP(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = Conv2dNormActivation(3, 8, 3, stride=2, norm_layer=norm, activation_layer=nn.Hardswish)
            self.low = nn.Sequential(InvertedResidual(cfg(8, 3, 16, 8, True, "RE", 2, 1), norm))
            self.high = nn.Sequential(InvertedResidual(cfg(8, 5, 24, 16, True, "HS", 2, 1), norm),
                                      InvertedResidual(cfg(16, 3, 32, 16, True, "HS", 1, 2), norm))
            self.head = LRASPPHead(8, 16, 3, 16)

        def forward(self, x):
            low = self.low(self.stem(x))
            out = self.head({"low": low, "high": self.high(low)})
            return {"out": F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)}

    return TinyLRASPP(), [1, 3, 48, 48]


def tiny_efficientnet_v2():
    """torchvision's EfficientNetV2 blocks: FusedMBConv (with and without expansion), MBConv with
    squeeze-excitation, SiLU, stochastic depth (the identity in eval)."""
    from torchvision.models.efficientnet import EfficientNet, FusedMBConvConfig, MBConvConfig

    setting = [FusedMBConvConfig(1, 3, 1, 8, 8, 1), FusedMBConvConfig(4, 3, 2, 8, 16, 1), MBConvConfig(4, 3, 2, 16, 24, 2)]
    return EfficientNet(setting, dropout=0.2, last_channel=32, num_classes=10), [1, 3, 32, 32]


def tiny_regnet():
    """torchvision's RegNet-Y blocks: grouped 3x3 convs, squeeze-excitation with ReLU and sigmoid."""
    from torchvision.models.regnet import BlockParams, RegNet

    params = BlockParams.from_init_params(depth=3, w_0=8, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return RegNet(params, stem_width=8, num_classes=10), [1, 3, 32, 32]


def tiny_yolov8():
    """Ultralytics' YOLOv8 (needs `ultralytics`): C2f's chunk and cat, SPPF, nearest upsampling,
    Detect's DFL softmax and box decoding, at 1/32 of yolov8n's width, 2 classes, reg_max 4."""
    from ultralytics.nn.tasks import DetectionModel, yaml_model_load

    from import_check import YoloPredictions

    cfg = yaml_model_load("yolov8n.yaml")
    cfg.update(scales={"n": [0.33, 0.03125, 1024]}, scale="n", nc=2, reg_max=4)
    model = DetectionModel(cfg, nc=2, verbose=False)
    # Ultralytics' class bias puts every score near 1e-5 (its prior): at 0 the scores spread around
    # 0.5 and weigh in the comparison beside the boxes' pixels.
    for branch in model.model[-1].cv3:
        nn.init.zeros_(branch[-1].bias)
    return YoloPredictions(model), [1, 3, 64, 64]


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
    "tiny_lraspp": tiny_lraspp,
    "tiny_efficientnet_v2": tiny_efficientnet_v2,
    "tiny_regnet": tiny_regnet,
    "tiny_yolov8": tiny_yolov8,
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
