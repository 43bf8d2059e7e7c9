"""Exports models with kiln-torch and checks them with Kiln's CPU executor (docs/IMPORT.md, "Checks").

For each model: export it (torchvision's own init, `torch.manual_seed(0)`) with its PyTorch outputs
as a reference, run `kiln compare <file> --reference ... --cpu` (relative L2), and count the
optimised graph's ops (`kiln inspect --no-engine`) beside the bundled definition's, when Kiln bundles
the model. Prints a Markdown table.

    python3 tools/import_check.py --kiln target/release/kiln --out /tmp/imported resnet18 swin_t handwritten
    python3 tools/import_check.py --kiln target/release/kiln --out /tmp/imported --all
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

BUNDLED = [
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "wide_resnet50_2", "alexnet", "vgg16",
    "vgg16_bn", "squeezenet1_0", "squeezenet1_1", "densenet121", "googlenet", "mobilenet_v2", "mobilenet_v3_large",
    "efficientnet_b0", "shufflenet_v2_x1_0", "regnet_y_400mf", "convnext_tiny", "swin_t", "vit_b_16",
]
YOLO = ["yolov8n"]
NEW = ["deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large", "fcn_resnet50", "efficientnet_v2_s", "regnet_y_800mf", "handwritten"]
SEGMENTATION = {"deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large", "fcn_resnet50"}


class Handwritten(nn.Module):
    """Functional calls Kiln's own models write with modules: F.interpolate, torch.cat, chunk,
    x * torch.sigmoid(x), x.view."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.branch = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Conv2d(16, 8, 1)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = x * torch.sigmoid(x)
        a, b = x.chunk(2, dim=1)
        b = self.branch(b)
        x = torch.cat([a, F.relu(b)], dim=1)
        x = F.interpolate(x, scale_factor=0.5, mode="bilinear", align_corners=False)
        x = F.interpolate(self.head(x), size=(16, 16), mode="nearest")
        return self.fc(x.view(x.size(0), -1))


class YoloPredictions(nn.Module):
    """A YOLO's decoded predictions `[N, 84, anchors]`, the output Kiln's bundled YOLOs compare."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def measure_batch_norm(model, shape, batches=2):
    """BatchNorm statistics measured on random images (a cumulative average), so that activations
    keep their spread through a deep randomly initialised network (drawn statistics leave
    DeepLabV3's output spatially constant)."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None
    gen = torch.Generator().manual_seed(3)
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(torch.rand(shape, generator=gen) * 2 - 1)
    model.eval()


def build(name: str):
    """(model, input shape)."""
    import torchvision

    torch.manual_seed(0)
    if name in YOLO:
        # Ultralytics' DetectionModel with its own random init (needs `ultralytics`; YOLO_OFFLINE=1).
        from ultralytics.nn.tasks import DetectionModel

        return YoloPredictions(DetectionModel(f"{name}.yaml", verbose=False).eval()), [1, 3, 640, 640]
    if name == "handwritten":
        return Handwritten().eval(), [1, 3, 64, 64]
    if name in SEGMENTATION:
        m = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
        if name == "fcn_resnet50":
            # Measured statistics make FCN ill-conditioned: PyTorch's own f32 output is 9.5e-5 from
            # its f64 one. Drawn ones keep its output varied (std 8) and well-conditioned.
            draw_batch_norm(m)
        else:
            measure_batch_norm(m, [2, 3, 520, 520])
        return m.eval(), [1, 3, 520, 520]
    kwargs = {"weights": None}
    if name == "googlenet":
        kwargs.update(aux_logits=False, transform_input=False, init_weights=True)
    m = getattr(torchvision.models, name)(**kwargs).eval()
    if name == "vit_b_16":
        # torchvision zero-initialises the head: logits would all be 0.
        nn.init.normal_(m.heads.head.weight, std=0.02)
    draw_batch_norm(m)
    if name in ("resnet101", "resnet152"):
        # 33 and 50 residual sums at unit scale grow past FP16's range (f32 activations reach 3e5
        # and 6e8; PyTorch's own FP16 gives NaN): each block's last BatchNorm scale is drawn in
        # [0.2, 0.5], as trained ResNets have them, which keeps them under 50 (f32 vs f64 5e-7).
        gen = torch.Generator().manual_seed(2)
        for path, mod in m.named_modules():
            if path.endswith("bn3"):
                mod.weight.data.copy_(torch.rand(mod.weight.shape, generator=gen) * 0.3 + 0.2)
    return m, [1, 3, 224, 224]


def draw_batch_norm(model):
    """BatchNorm statistics drawn around (0, 1), so that BN is not the identity."""
    gen = torch.Generator().manual_seed(1)
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.rand(mod.running_mean.shape, generator=gen) * 0.2 - 0.1)
            mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=gen) * 0.5 + 0.75)


def run(cmd) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    return p.stdout + p.stderr


def optimised_ops(kiln: str, model: str) -> int | None:
    text = run([kiln, "inspect", model, "--no-engine"])
    m = re.search(r"== optimised graph.*?==\n(\d+) ops", text, re.S)
    return int(m.group(1)) if m else None


def check(name: str, kiln: str, out: Path) -> dict:
    import kiln_torch

    model, shape = build(name)
    path, ref = out / f"{name}.kiln.safetensors", out / f"{name}.reference.safetensors"
    gen = torch.Generator().manual_seed(7)
    x = torch.rand(shape, generator=gen) * 2 - 1
    row = {"model": name}
    t = time.time()
    try:
        kiln_torch.export(model, (x,), path, input_names=["input"], reference=ref, model_name=name)
    except kiln_torch.UnsupportedOpsError as e:
        row["error"] = "missing: " + ", ".join(sorted({m.op for m in e.missing}))
        print(e, file=sys.stderr)
        return row
    row["export_s"] = round(time.time() - t, 1)
    text = run([kiln, "compare", str(path), "--reference", str(ref), "--cpu", "--l2-tol", "1e-5"])
    errors = [float(v) for v in re.findall(r"rel_l2 ([0-9.eE+-]+)", text)]
    row["rel_l2"] = max(errors) if errors else None
    row["pass"] = "PASS" in text and errors
    if not errors:
        row["error"] = text.strip().splitlines()[-1] if text.strip() else "kiln compare printed nothing"
    row["ops"] = optimised_ops(kiln, str(path))
    if name in BUNDLED:
        row["bundled_ops"] = optimised_ops(kiln, name)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*")
    p.add_argument("--all", action="store_true", help="every bundled classifier and the new models")
    p.add_argument("--kiln", default="target/release/kiln")
    p.add_argument("--out", default="/tmp/imported")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = (BUNDLED + NEW + YOLO) if a.all else a.models
    rows = []
    print("| model | rel L2 (CPU) | optimised ops | bundled ops | note |")
    print("|---|---|---|---|---|")
    for name in names:
        r = check(name, a.kiln, out)
        rows.append(r)
        l2 = f"{r['rel_l2']:.1e}" if r.get("rel_l2") is not None else "-"
        print(f"| {name} | {l2} | {r.get('ops', '-')} | {r.get('bundled_ops', '-')} | {r.get('error', '')} |", flush=True)
    return 0 if all(r.get("pass") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
