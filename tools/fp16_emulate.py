#!/usr/bin/env python3
"""Emulates a Kiln FP16 engine on the CPU, to see what FP16 costs a model before a device run.

The model is built as `export_reference.py` builds it (`--weights torchvision`: random init with
measured BatchNorm statistics, YOLO's calibrated head), BatchNorm is folded into the convolutions
as Kiln's passes do, and every leaf module not kept in FP32 computes from f16-rounded weights and
inputs and stores an f16-rounded output (f32 accumulation). `--fp32` takes module-path patterns as
`--layer-precisions` does (a pattern covers the path and what is under it; `*`, `?`).
`--consistent-batchnorm` measures the BatchNorm statistics through the drawn affine parameters, as
tools/export_fp16_reference.py does (export_reference.randomise_batchnorm says why); `--torch-half`
also prints PyTorch's own `.half()` run on the CPU, the figure tests/gpu_fidelity.rs compares with.

  python3 tools/fp16_emulate.py --model regnet_y_400mf --fp32 stem,trunk_output.block1,trunk_output.block2
  PYTHONPATH=/tmp/ulsite YOLO_OFFLINE=1 python3 tools/fp16_emulate.py --model yolov8n

For a classifier it prints the logits' rel L2 against FP32; for a YOLO the share of the FP32
detections matched (same class, IoU >= 0.9, as tests/gpu_yolo.rs) with the decode chain in f16
(each step rounded, as Kiln did before the decode was required in FP32) and in f32.
"""

import argparse
import copy
import fnmatch
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_reference as er  # noqa: E402
import seeded  # noqa: E402


def r16(t):
    return t.half().float()


def covered(path, patterns):
    parts = path.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), p) for p in patterns for i in range(1, len(parts) + 1))


def fold_batchnorm(net):
    net = copy.deepcopy(net)
    for m in net.modules():
        kids = list(m.named_children())
        for (_, a), (n2, b) in zip(kids, kids[1:]):
            if isinstance(a, nn.Conv2d) and isinstance(b, nn.BatchNorm2d):
                s = b.weight / torch.sqrt(b.running_var + b.eps)
                bias = a.bias if a.bias is not None else torch.zeros_like(b.running_mean)
                a.weight.copy_(a.weight * s.view(-1, 1, 1, 1))
                a.bias = nn.Parameter((bias - b.running_mean) * s + b.bias)
                setattr(m, n2, nn.Identity())
    return net


def emulate(net, fp32):
    net = copy.deepcopy(net)
    for name, mod in net.named_modules():
        if not name or list(mod.children()) or covered(name, fp32):
            continue
        for p in mod.parameters(recurse=False):
            p.copy_(r16(p))
        mod.register_forward_pre_hook(lambda m, i: tuple(r16(t) if torch.is_tensor(t) else t for t in i))
        mod.register_forward_hook(lambda m, i, o: r16(o))
    return net


def yolo_share(got, want):
    g, w = got[0][got[0][:, 5] >= 0], want[0][want[0][:, 5] >= 0]
    lt = torch.maximum(w[:, None, :2], g[None, :, :2])
    rb = torch.minimum(w[:, None, 2:4], g[None, :, 2:4])
    inter = (rb - lt).clamp(min=0).prod(2)
    area = lambda r: (r[:, 2] - r[:, 0]) * (r[:, 3] - r[:, 1])  # noqa: E731
    iou = inter / (area(w)[:, None] + area(g)[None, :] - inter)
    ok = ((iou >= 0.9) & (w[:, 5:6] == g[None, :, 5])).any(1)
    return int(ok.sum()), len(w)


def yolo_decode(head, raw, rd):
    """Detect's eval decode with `rd` applied after every step, as an engine stores each node."""
    from ultralytics.utils.tal import make_anchors

    anchors, strides = (t.transpose(0, 1) for t in make_anchors(raw["feats"], head.stride, 0.5))
    n = raw["boxes"].shape[0]
    bins = rd(rd(raw["boxes"]).view(n, 4, head.reg_max, -1).transpose(2, 1).softmax(1))
    dist = rd((bins * torch.arange(float(head.reg_max)).view(1, -1, 1, 1)).sum(1))
    lt, rb = dist.chunk(2, 1)
    x1y1, x2y2 = rd(-rd(lt - anchors)), rd(rb + anchors)
    dbox = rd(torch.cat([rd(rd(x1y1 + x2y2) * 0.5), rd(x2y2 - x1y1)], 1) * strides)
    return torch.cat([dbox, rd(raw["scores"].sigmoid())], 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    er.load_models()
    p.add_argument("--model", required=True, choices=list(er.MODELS))
    p.add_argument("--fp32", default="", help="comma-separated module-path patterns kept in FP32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--consistent-batchnorm", action="store_true", help="BatchNorm statistics measured through the drawn affine parameters")
    p.add_argument("--torch-half", action="store_true", help="also PyTorch's own FP16 (.half()) on the CPU")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    fp32 = [s for s in args.fp32.split(",") if s]
    net = er.load_weights(args.model, er.build(args.model), "torchvision", 0, args.consistent_batchnorm).eval().float()
    size = er.default_size(args.model)
    x = torch.from_numpy(seeded.weight("input.0", [args.batch, 3, size, size]))
    if er.family(args.model) == "yolo":
        want = net(x)[0]
        fused = copy.deepcopy(net).fuse()
        head = fused.model[-1]
        y, raw = emulate(fused, fp32)(r16(x))
        ref_det = er.yolo_nms(want)
        for label, rd in [("decode in f16", r16), ("decode in f32", lambda t: t)]:
            pred = yolo_decode(head, raw, rd)
            m, total = yolo_share(er.yolo_nms(pred), ref_det)
            rel = ((pred - want).norm() / want.norm()).item()
            print(f"{args.model} FP16 (fp32: {fp32}), {label}: predictions rel L2 {rel:.2e}, {m} of {total} detections matched ({100 * m / total:.1f}%)")
        return
    want = net(x).double()
    got = emulate(fold_batchnorm(net), fp32)(x if covered("stem", fp32) else r16(x)).double()
    print(f"{args.model} FP16 (fp32: {fp32}): logits rel L2 {((got - want).norm() / want.norm()).item():.3e}")
    if args.torch_half:
        half = copy.deepcopy(net).half()(x.half()).double()
        print(f"{args.model} PyTorch's own FP16 (.half() on the CPU): logits rel L2 {((half - want).norm() / want.norm()).item():.3e}")


if __name__ == "__main__":
    main()
