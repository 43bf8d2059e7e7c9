#!/usr/bin/env python3
"""YOLOv8n and YOLO11n beside Ultralytics' PyTorch model, NMS included on both sides, at 640x640,
FP16, batch 1 and 32: docs/BENCHMARKS.md's YOLO rows.

Both sides run the same weights: Ultralytics' random init with measured BatchNorm statistics and a
calibrated head (tools/export_reference.py --weights torchvision), so NMS sees a realistic number of
candidates (hundreds to thousands per image, 300 kept). Kiln: `kiln bench <model> --weights ...`
(FP16, CUDA graphs; the bundled model's engine ends with the `yolo_nms` layer). PyTorch:
`DetectionModel(yaml)`, fused (conv+BN, as Ultralytics' predictor does), FP16, the forward under a
CUDA graph or torch.compile (reduce-overhead), then Ultralytics' own `non_max_suppression`
(torchvision.ops.nms; conf 0.25, IoU 0.7, max_det 300), which cannot be graph-captured
(data-dependent shapes) and runs eagerly after it. Times are per batch, synchronised.

  here:    cargo build --release -p kiln-models --bin kiln && cp target/release/kiln .carry/bin/
           pip download --no-deps -d .whl ultralytics==8.4.190 ultralytics-thop==2.2.3
  device:  pip install --no-index --no-deps --target .carry/py .whl/*.whl
           PYTHONPATH=.carry/py python3 .carry/tools/bench_yolo.py --kiln .carry/bin/kiln --out $OUT [--compile]
  here:    python3 tools/bench_yolo.py --render <files_at>/yolo.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zoo import graphed, kiln_bench, timed  # noqa: E402

MODELS = ["yolov8n", "yolo11n"]
BATCHES = [1, 32]
SIZE = 640


def weights(model, out):
    """The shared weights: export_reference's Ultralytics init, saved for Kiln; the model for PyTorch."""
    import torch
    from safetensors.torch import save_file

    import export_reference as er

    torch.set_grad_enabled(False)
    net = er.load_weights(model, er.build(model), "torchvision", 0).eval()
    path = os.path.join(out, f"{model}.weights.safetensors")
    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, path)
    return net, path


def torch_peers(model, net, compile_):
    import torch
    from ultralytics.utils.nms import non_max_suppression

    torch.backends.cudnn.benchmark = True
    m = net.fuse(verbose=False) if "verbose" in net.fuse.__code__.co_varnames else net.fuse()
    m = m.eval().cuda().half()

    def first(y):
        return y[0] if isinstance(y, (tuple, list)) else y

    def with_nms(forward):
        return lambda x: non_max_suppression(forward(x), conf_thres=0.25, iou_thres=0.7, max_det=300)

    rows, kept = [], {}
    with torch.inference_mode():
        for b in BATCHES:
            x = torch.rand(b, 3, SIZE, SIZE, device="cuda").half()
            fwd = graphed(lambda t: first(m(t)), x)
            ms = timed(with_nms(fwd), x, 100 if b == 1 else 30)
            kept[b] = [len(d) for d in with_nms(fwd)(x)]
            rows.append(dict(model=model, peer="Ultralytics fp16 cuda-graph + nms", batch=b, ms=ms, img_s=b / ms * 1e3))
            fwd_ms = timed(fwd, x, 100 if b == 1 else 30)
            rows.append(dict(model=model, peer="Ultralytics fp16 cuda-graph (no nms)", batch=b, ms=fwd_ms, img_s=b / fwd_ms * 1e3))
        if compile_:
            for b in BATCHES:
                torch._dynamo.reset()
                c = torch.compile(m, mode="reduce-overhead")
                x = torch.rand(b, 3, SIZE, SIZE, device="cuda").half()
                ms = timed(with_nms(lambda t: first(c(t)).clone()), x, 100 if b == 1 else 30)
                rows.append(dict(model=model, peer="torch.compile reduce-overhead + nms", batch=b, ms=ms, img_s=b / ms * 1e3))
    for r in rows:
        print(f"{r['model']:8s} {r['peer']:40s} b={r['batch']:<3d} {r['ms']:8.3f} ms {r['img_s']:10.0f} img/s", flush=True)
    print(f"{model}: PyTorch detections per image (first images): { {b: k[:4] for b, k in kept.items()} }", flush=True)
    return rows


def device(args):
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("YOLO_OFFLINE", "1")
    result = {"kiln": [], "peers": []}
    path = os.path.join(args.out, "yolo.json")
    start = time.time()
    for model in [m for m in MODELS if not args.models or m in args.models.split(",")]:
        net, wpath = weights(model, args.out)
        result["kiln"] += kiln_bench(args.kiln, model, BATCHES, os.path.join(args.out, "kiln.json"), 2, extra=["--weights", wpath], warmup_ms=100)
        result["peers"] += torch_peers(model, net, args.compile)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(f"yolo bench done in {time.time() - start:.0f} s", flush=True)


def render(path):
    with open(path) as f:
        r = json.load(f)
    kiln = {(x["model"], x["batch"]): x for x in r["kiln"]}
    peers = sorted({x["peer"] for x in r["peers"]})
    peer = {(x["model"], x["peer"], x["batch"]): x for x in r["peers"]}
    print("| model | batch | Kiln ms (NMS incl.) | " + " | ".join(f"{p} ms | ratio" for p in peers) + " |")
    print("|---|---|---|" + "---|---|" * len(peers))
    for model in dict.fromkeys(x["model"] for x in r["kiln"]):
        for b in BATCHES:
            k = kiln.get((model, b))
            kms = k["median_ms"] if k else None
            cells = []
            for p in peers:
                x = peer.get((model, p, b))
                cells += [f"{x['ms']:.3f}" if x else "–", f"{x['ms'] / kms:.2f}×" if (x and kms) else "–"]
            print(f"| {model} | {b} | {kms:.3f} | " + " | ".join(cells) + " |" if kms else f"| {model} | {b} | – | " + " | ".join(cells) + " |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kiln", help="the kiln binary (device)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--models", default="", help="comma-separated subset of yolov8n,yolo11n")
    p.add_argument("--compile", action="store_true", help="also torch.compile (reduce-overhead)")
    p.add_argument("--render", help="a yolo.json from the device: print the markdown table")
    args = p.parse_args()
    if args.render:
        render(args.render)
    elif args.kiln:
        device(args)
    else:
        sys.exit("give --kiln (on the device) or --render (here)")


if __name__ == "__main__":
    main()
