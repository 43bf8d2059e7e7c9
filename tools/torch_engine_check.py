#!/usr/bin/env python3
"""kiln-torch's engine check (issue 26, item 4): torchvision models exported with kiln-torch, built
into FP32 (TF32 off) and FP16 Kiln engines, compared with PyTorch, and the segmentation models
timed beside PyTorch FP16 + CUDA graph. Run on the device by tools/torch-engine-check.sh; on a
machine without a GPU, `--cpu` checks the exports on Kiln's CPU executor instead.

For each model: build it as tools/import_check.py does (torchvision's random init, seed 0,
BatchNorm statistics drawn or measured), export it with its PyTorch outputs as the reference
(computed on the CPU in f32, so TF32 never enters), then per precision `kiln compare <file>
--reference <ref> --save-outputs <out>` and, from the saved outputs, the relative L2 and the top-1
(classifiers) or per-pixel argmax (segmentation) agreement. Bounds: CPU 1e-5, FP32 1e-4, FP16 1e-2
with the same top-1 (every image) or argmax (at least --argmax-agree of the pixels).

`--bench` times the segmentation models at --bench-batches with `kiln bench --fp16
--cuda-graphs-only` and PyTorch FP16 channels_last in a CUDA graph (median of CUDA-event-timed
calls) and writes the table of docs/BENCHMARKS.md (ratio = PyTorch / Kiln: above 1, Kiln is faster).

    python3 tools/torch_engine_check.py --kiln .carry/kiln/kiln --out $OUT/torch-check --bench
    python3 tools/torch_engine_check.py --kiln target/release/kiln --out /tmp/tec --cpu resnet50 lraspp_mobilenet_v3_large
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import import_check as ic  # noqa: E402

CLASSIFIERS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny", "vit_b_16", "swin_t"]
SEGMENTATION = ["fcn_resnet50", "deeplabv3_resnet50", "lraspp_mobilenet_v3_large"]
# Segmentation models whose BatchNorm statistics are measured on random images (drawn ones leave
# the output constant over the image); the others keep drawn ones (import_check.build).
MEASURED_BN = {"deeplabv3_resnet50", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"}
BOUNDS = {"cpu": 1e-5, "fp32": 1e-4, "fp16": 1e-2}
# Kiln's binaries need the system cuDNN and CUDA 13 libraries (tools/gpu-test.sh); PyTorch must
# not see them, so only the kiln commands get this.
KILN_LD = os.environ.get("KILN_LD", "")


def build(name: str):
    """(model, input shape): import_check's models, and DeepLabV3-ResNet50 at 520×520."""
    if name not in ("deeplabv3_resnet50",):
        return ic.build(name)
    import torchvision

    torch.manual_seed(0)
    m = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
    ic.measure_batch_norm(m, [2, 3, 520, 520])
    return m.eval(), [1, 3, 520, 520]


def kiln(cmd: list[str], log) -> tuple[int, str]:
    env = dict(os.environ)
    if KILN_LD:
        env["LD_LIBRARY_PATH"] = KILN_LD
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    text = p.stdout + p.stderr
    log.write(f"$ {' '.join(cmd)}  ({time.time() - t:.1f} s, exit {p.returncode})\n{text}\n")
    log.flush()
    return p.returncode, text


def read(path: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(path))


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def agreement(got: np.ndarray, want: np.ndarray) -> float:
    """The fraction of images whose top-1 class agrees (logits `[N, classes]`), or of pixels whose
    argmax over the classes agrees (segmentation maps `[N, classes, H, W]`)."""
    return float(np.mean(np.argmax(got, axis=1) == np.argmax(want, axis=1)))


def check_precision(kiln_bin, path, ref, out, precision, segmentation, argmax_agree, log) -> dict:
    saved = out / f"{path.name.removesuffix('.kiln.safetensors')}.{precision}.outputs.safetensors"
    flag = "--cpu" if precision == "cpu" else f"--{precision}"
    cmd = [kiln_bin, "compare", str(path), "--reference", str(ref), flag, "--l2-tol", str(BOUNDS[precision]), "--save-outputs",
           str(saved)]
    rc, text = kiln(cmd, log)
    row = {"precision": precision, "bound": BOUNDS[precision]}
    if not saved.exists():
        row["error"] = (text.strip().splitlines() or [f"kiln compare exited {rc}"])[-1]
        return row
    got, want = read(saved), read(ref)
    worst, agree = 0.0, 1.0
    for key, r in want.items():
        if not key.startswith("output.") or key not in got:
            continue
        if got[key].shape != r.shape:
            row["error"] = f"{key}: shape {list(got[key].shape)}, PyTorch's {list(r.shape)}"
            return row
        worst = max(worst, rel_l2(got[key], r))
        if r.ndim >= 2 and r.shape[1] > 1:
            agree = min(agree, agreement(got[key], r))
    row["rel_l2"], row["agree"] = worst, agree
    need = argmax_agree if segmentation else 1.0
    row["pass"] = worst <= BOUNDS[precision] and (precision != "fp16" or agree >= need)
    return row


def bench_kiln(kiln_bin, path, batches, out, log) -> dict:
    js = out / f"{path.name.removesuffix('.kiln.safetensors')}.bench.json"
    cmd = [kiln_bin, "bench", str(path), "--fp16", "--cuda-graphs-only", "--batch", ",".join(map(str, batches)), "--json", str(js)]
    kiln(cmd, log)
    if not js.exists():
        return {}
    return {r["batch"]: r["median_ms"] for r in json.loads(js.read_text())}


def bench_torch(model, shape, batches, target_s=2.0) -> dict:
    """PyTorch FP16, channels_last, in a CUDA graph: median ms per batch (bench_torch's timer)."""
    import bench_torch as bt

    torch.backends.cudnn.benchmark = True
    m = model.half().cuda().to(memory_format=torch.channels_last).eval()
    times = {}
    for b in batches:
        x = torch.rand([b] + shape[1:], device="cuda").half().to(memory_format=torch.channels_last)
        with torch.no_grad():
            fn = bt.graphed(lambda t: m(t), x)
            times[b], _ = bt.timed(fn, x, target_s, (20, 2000))
        del fn, x
        torch.cuda.empty_cache()
    return times


def check(name, a, out, log) -> tuple[list[dict], list[dict]]:
    import kiln_torch

    model, shape = build(name)
    seg = name in SEGMENTATION or name in ic.SEGMENTATION
    path, ref = out / f"{name}.kiln.safetensors", out / f"{name}.reference.safetensors"
    x = torch.rand(shape, generator=torch.Generator().manual_seed(7)) * 2 - 1
    t = time.time()
    try:
        kiln_torch.export(model, (x,), path, input_names=["input"], reference=ref, model_name=name)
    except Exception as e:  # an unsupported op or a capture failure: the row says which
        print(e, file=log)
        return [{"model": name, "precision": "export", "error": str(e).strip().splitlines()[0]}], []
    export_s = time.time() - t
    rows = []
    for p in a.precisions:
        r = check_precision(a.kiln, path, ref, out, p, seg, a.argmax_agree, log)
        rows.append(dict(r, model=name, export_s=round(export_s, 1)))
        print(row_text(rows[-1], seg), flush=True)
    bench = []
    if a.bench and seg:
        ours = bench_kiln(a.kiln, path, a.bench_batches, out, log)
        peer = bench_torch(model, shape, a.bench_batches) if torch.cuda.is_available() else {}
        for b in a.bench_batches:
            bench.append({"model": name, "batch": b, "kiln_ms": ours.get(b), "torch_ms": peer.get(b)})
    for f in out.glob(f"{name}.*.outputs.safetensors"):
        f.unlink()  # large at 520×520; the table keeps what they showed
    return rows, bench


def row_text(r: dict, seg: bool) -> str:
    l2 = f"{r['rel_l2']:.1e}" if r.get("rel_l2") is not None else "-"
    what = "argmax" if seg else "top-1"
    agree = f"{what} {100 * r['agree']:.2f}%" if r.get("agree") is not None else "-"
    verdict = "pass" if r.get("pass") else "FAIL"
    bound = f" (≤ {r['bound']:.0e})" if "bound" in r else ""
    return f"| {r['model']} | {r['precision']} | {l2}{bound} | {agree} | {verdict} | {r.get('error', '')} |"


def bench_table(bench: list[dict], device: str) -> str:
    lines = [f"Segmentation at 520×520, FP16, CUDA graphs, median ms ({device}); ratio = PyTorch / Kiln.", "",
             "| model | batch | Kiln FP16 | PyTorch FP16 + CUDA graph | ratio |", "|---|---|---|---|---|"]
    for b in bench:
        k, t = b["kiln_ms"], b["torch_ms"]
        ratio = f"{t / k:.2f}" if k and t else "-"
        fmt = lambda v: f"{v:.2f}" if v else "-"  # noqa: E731
        lines.append(f"| {b['model']} | {b['batch']} | {fmt(k)} | {fmt(t)} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help=f"default: {' '.join(CLASSIFIERS + SEGMENTATION)}")
    p.add_argument("--kiln", default="target/release/kiln")
    p.add_argument("--out", default="/tmp/torch-engine-check")
    p.add_argument("--cpu", action="store_true", help="the CPU executor only (no GPU needed)")
    p.add_argument("--bench", action="store_true", help="also time the segmentation models against PyTorch")
    p.add_argument("--bench-batches", default="1,16", type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--argmax-agree", type=float, default=0.99, help="FP16 segmentation: least fraction of pixels whose argmax agrees")
    a = p.parse_args()
    a.precisions = ["cpu"] if a.cpu else ["fp32", "fp16"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    names = a.models or CLASSIFIERS + SEGMENTATION
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not a.cpu else "CPU"
    header = ["| model | engine | rel L2 (bound) | agreement | verdict | note |", "|---|---|---|---|---|---|"]
    print("\n".join(header), flush=True)
    rows, bench = [], []
    with open(out / "kiln.log", "w") as log:
        for name in names:
            r, b = check(name, a, out, log)
            rows += r
            bench += b
            (out / "results.json").write_text(json.dumps({"device": device, "rows": rows, "bench": bench}, indent=1))
    md = [f"kiln-torch engine check on {device}", ""] + header
    md += [row_text(r, r["model"] in SEGMENTATION or r["model"] in ic.SEGMENTATION) for r in rows]
    if bench:
        md += ["", bench_table(bench, device)]
    (out / "results.md").write_text("\n".join(md) + "\n")
    if bench:
        print("\n" + bench_table(bench, device), flush=True)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    return 0 if rows and all(r.get("pass") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
