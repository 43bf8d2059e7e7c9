"""How many of a YOLO's FP32 detections PyTorch's own FP16 keeps: the baseline for Kiln's FP16 check.

tests/gpu_yolo.rs asks an FP16 Kiln engine to keep >= 98% of Ultralytics' FP32 post-NMS detections
(same class, IoU >= 0.9). This script measures the same share for Ultralytics' model itself run in
FP16 on the GPU (`model.half()`, as its predictor does with `half=True`), on the same weights
(`export_reference.py --weights torchvision`: Ultralytics' init, BatchNorm statistics randomised,
head calibrated) and the same seeded inputs. If PyTorch's FP16 falls short too, the shortfall is a
property of the network and the threshold, not of Kiln's kernels.

    python3 tools/yolo_fp16_baseline.py --model yolo11n --images 8
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_reference as ref  # noqa: E402
import seeded  # noqa: E402


def iou(a, b):
    iw = (min(a[2], b[2]) - max(a[0], b[0])).clamp(min=0)
    ih = (min(a[3], b[3]) - max(a[1], b[1])).clamp(min=0)
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def matched(got, want):
    """Share of `want`'s rows (one image, [K, 6], class -1 = padding) that `got` has too."""
    g = [r for r in got if r[5] >= 0]
    w = [r for r in want if r[5] >= 0]
    m = sum(1 for wr in w if any(gr[5] == wr[5] and iou(gr, wr) >= 0.9 for gr in g))
    return m, len(w)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="yolo11n", choices=list(ref.YOLO))
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_grad_enabled(False)

    net = ref.load_weights(args.model, ref.build(args.model), "torchvision", args.seed).eval().float().to(args.device)
    size = ref.MODELS[args.model]
    # input.{seed} is the reference's input (batch 1 there); more images come from other seeds.
    xs = [torch.from_numpy(seeded.weight(f"input.{args.seed + i}", [1, 3, size, size])) for i in range(args.images)]
    x = torch.cat(xs).to(args.device)
    want = ref.yolo_nms(net(x)[0].float().cpu())
    net16 = net.half()
    for name, pred in [("fp16", net16(x.half())[0].float().cpu())]:
        got = ref.yolo_nms(pred)
        tm = tt = 0
        for n in range(x.shape[0]):
            m, t = matched(got[n], want[n])
            tm, tt = tm + m, tt + t
            print(f"{args.model} PyTorch {name} image {n}: {m} of {t} FP32 detections kept ({100 * m / max(t, 1):.1f}%)")
        print(f"BASELINE {args.model} PyTorch {name}: {tm} of {tt} ({100 * tm / max(tt, 1):.1f}%)")


if __name__ == "__main__":
    main()
