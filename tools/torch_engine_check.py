#!/usr/bin/env python3
"""kiln-torch's device check (issue 26, item 4), in one run of about 6 minutes on one H100: every
model exported with kiln-torch, checked on Kiln's CPU executor and in FP32 (TF32 off) and FP16
engines against PyTorch, its optimised layer count beside the bundled definition's, `kiln build`,
`kiln run` and `kiln bench` on the exported file, then the segmentation models timed beside
PyTorch FP16 + CUDA graph. Run on the device by tools/torch-engine-check.sh; without a GPU, `--cpu`
does the CPU half only.

The models (`all`): every bundled torchvision classifier (tools/import_check.py's BUNDLED, Swin-T and
ViT-B/16 among them), YOLOv8n (Ultralytics, from carried wheels) and the models Kiln has never seen
(deeplabv3_mobilenet_v3_large, lraspp_mobilenet_v3_large, fcn_resnet50, efficientnet_v2_s,
regnet_y_800mf, the hand-written functional module). Each is built as tools/import_check.py does
(random init, seed 0, BatchNorm statistics drawn or measured) and exported with its PyTorch outputs
(computed on the CPU in f32, so TF32 never enters) as the reference.

The run, with the CPU work spread over processes:
  1. exports, --jobs processes of --threads torch threads each, heaviest first;
  2. per exported model, as soon as it is written: `kiln compare --cpu` (--cpu-jobs at a time),
     `kiln inspect --no-engine` of the file and of the bundled definition (layer counts), and on
     the GPU (--gpu-lanes models at a time, after one warm-up that fills the kernel cache):
     `kiln compare --fp32`, `kiln compare --fp16` (which writes the model's timing cache), then
     `kiln build`, `kiln run` and `kiln bench` (FP16, batch 1, 50 ms) on the exported file with that
     cache;
  3. with nothing else on the GPU (--bench): the segmentation models at --bench-batches, `kiln bench
     --fp16 --cuda-graphs-only` beside PyTorch FP16 channels_last in a CUDA graph (median of
     CUDA-event-timed calls, about --bench-s seconds each).
Bounds: CPU rel L2 1e-5; FP32 1e-4; FP16 1e-2 with the same top-1 on every image (classifiers) or
the same argmax on at least --argmax-agree of the pixels (segmentation); YOLOv8n's FP16 is judged
by rel L2 alone (random weights leave its class scores tied, so their argmax is noise).

Results in --out: results.md (the table for the issue's closing note and the benchmark table),
results.json (the check rows, and the benchmark in tools/bench_all.py's format: `python3
tools/bench_all.py render results.json --tables segmentation` writes docs/BENCHMARKS.md's table),
kiln.log (every kiln command and its output), check.log (the console).

    python3 tools/torch_engine_check.py --kiln .carry/kiln/kiln --out $OUT/torch-check --bench
    python3 tools/torch_engine_check.py --kiln target/release/kiln --out /tmp/tec --cpu resnet18 handwritten
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import json
import multiprocessing
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.join(os.path.dirname(TOOLS), "python"))
import import_check as ic  # noqa: E402

SEGMENTATION = sorted(ic.SEGMENTATION)
MODELS = ic.BUNDLED + ic.YOLO + ic.NEW
GROUPS = {"all": MODELS, "classify": ic.BUNDLED, "new": ic.NEW, "segment": SEGMENTATION, "yolo": ic.YOLO}
# Export and CPU-check cost, heaviest first, so that the longest ones start first (the others
# follow in MODELS' order).
HEAVY = ["fcn_resnet50", "vit_b_16", "swin_t", "yolov8n", "deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large", "efficientnet_v2_s",
         "convnext_tiny", "vgg16_bn", "vgg16", "resnet152", "densenet121", "wide_resnet50_2", "resnet101"]
BOUNDS = {"cpu": 1e-5, "fp32": 1e-4, "fp16": 1e-2}
# Kiln's binaries need the system cuDNN and CUDA 13 libraries (tools/gpu-test.sh); PyTorch must
# not see them, so only the kiln commands get this.
KILN_LD = os.environ.get("KILN_LD", "")


def build(name: str, size: int | None = None):
    """(model, input shape): import_check's models (DeepLabV3-ResNet50 too, at 520×520); `size`
    replaces a segmentation model's 520 (BatchNorm statistics measured at that size)."""
    import torch
    import torchvision

    if name == "deeplabv3_resnet50" or (size and name in ic.SEGMENTATION):
        s = size or 520
        torch.manual_seed(0)
        m = getattr(torchvision.models.segmentation, name)(weights=None, weights_backbone=None)
        if name == "fcn_resnet50":
            ic.draw_batch_norm(m)
        else:
            ic.measure_batch_norm(m, [2, 3, s, s])
        return m.eval(), [1, 3, s, s]
    return ic.build(name)


def kind(name: str) -> str:
    if name in ic.SEGMENTATION or name == "deeplabv3_resnet50":
        return "segmentation"
    return "detection" if name in ic.YOLO else "classifier"


# ---- step 1: export (in worker processes) -------------------------------------------------------


def export_one(name: str, work: str, kiln_bin: str, threads: int, size: int | None) -> dict:
    """Builds and exports `name` into `work`; returns its row (export time, layer counts, error)."""
    import torch

    torch.set_num_threads(threads)
    import kiln_torch

    row = {"model": name, "kind": kind(name)}
    t = time.time()
    try:
        model, shape = build(name, size)
        x = torch.rand(shape, generator=torch.Generator().manual_seed(7)) * 2 - 1
        kiln_torch.export(model, (x,), f"{work}/{name}.kiln.safetensors", input_names=["input"],
                          reference=f"{work}/{name}.reference.safetensors", model_name=name)
    except Exception as e:  # an unsupported op or a capture failure: the row says which
        text = str(e).strip()
        with open(f"{work}/{name}.export-error.txt", "w") as f:
            f.write(f"{type(e).__name__}: {text}\n")
        row["error"] = "export: " + (text.splitlines() or [type(e).__name__])[0][:300]
        return row
    row["export_s"] = round(time.time() - t, 1)
    row["input"] = "x".join(map(str, shape))
    row["ops"] = optimised_ops(kiln_bin, f"{work}/{name}.kiln.safetensors")
    if name in ic.BUNDLED or name in ic.YOLO:
        row["bundled_ops"] = optimised_ops(kiln_bin, name)
    return row


def optimised_ops(kiln_bin: str, model: str) -> int | None:
    p = subprocess.run([kiln_bin, "inspect", model, "--no-engine"], capture_output=True, text=True, env=kiln_env({}))
    m = re.search(r"== optimised graph.*?==\n(\d+) ops", p.stdout + p.stderr, re.S)
    return int(m.group(1)) if m else None


# ---- step 2: kiln commands ----------------------------------------------------------------------


def kiln_env(extra: dict) -> dict:
    env = dict(os.environ, **extra)
    if KILN_LD:
        env["LD_LIBRARY_PATH"] = KILN_LD
    return env


class Kiln:
    """Runs kiln commands and logs each with its output and time (kiln.log, one block per command)."""

    def __init__(self, binary: str, log_path: Path, cache: str):
        self.binary, self.cache = binary, cache
        self.deadline = None  # no kiln command outlives it (time.time() seconds)
        self.log = open(log_path, "w")
        self.lock = threading.Lock()

    def __call__(self, args: list[str], threads: int | None = None, timeout: float = 240) -> tuple[int, str, float]:
        if self.deadline:
            timeout = max(min(timeout, self.deadline - time.time()), 5)
        env = kiln_env({"KILN_CACHE_DIR": self.cache})
        if threads:
            env["MATMUL_NUM_THREADS"] = str(threads)
        t = time.time()
        try:
            p = subprocess.run([self.binary, *args], capture_output=True, text=True, env=env, timeout=timeout)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = 124, f"{(e.stdout or b'').decode(errors='replace') if isinstance(e.stdout, bytes) else e.stdout or ''}\ntimed out after {timeout:.0f} s"
        s = time.time() - t
        with self.lock:
            self.log.write(f"$ kiln {' '.join(args)}  ({s:.1f} s, exit {rc})\n{text.rstrip()}\n\n")
            self.log.flush()
        return rc, text, s


def read(path: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(path)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    """‖got − want‖ / ‖want‖; infinite where either holds a NaN or an infinity (Python's `max` would
    otherwise drop a NaN and report 0)."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    if not (np.isfinite(got).all() and np.isfinite(want).all()):
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def agreement(got: np.ndarray, want: np.ndarray) -> float:
    """The fraction of images whose top-1 class agrees (logits `[N, classes]`), or of pixels whose
    argmax over the classes agrees (segmentation maps `[N, classes, H, W]`)."""
    return float(np.mean(np.argmax(got, axis=1) == np.argmax(want, axis=1)))


def last_line(text: str, rc: int) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1] if lines else f"exit {rc}")[:300]


def compare(kiln: Kiln, work: str, name: str, precision: str, argmax_agree: float, threads=None, extra=()) -> dict:
    """`kiln compare` in `precision` against PyTorch's outputs: {rel_l2, agree, pass, error, s}."""
    ref = f"{work}/{name}.reference.safetensors"
    saved = f"{work}/{name}.{precision}.outputs.safetensors"
    flag = "--cpu" if precision == "cpu" else f"--{precision}"
    rc, text, s = kiln(["compare", f"{work}/{name}.kiln.safetensors", "--reference", ref, flag, "--l2-tol", str(BOUNDS[precision]),
                        "--save-outputs", saved, *extra], threads=threads)
    r = {"s": round(s, 1)}
    if not os.path.exists(saved):
        r["error"] = f"{precision}: {last_line(text, rc)}"
        r["pass"] = False
        return r
    got, want = read(saved), read(ref)
    os.remove(saved)  # large at 520×520; the row keeps what they showed
    worst, agree = 0.0, 1.0
    for key, w in want.items():
        if not key.startswith("output."):
            continue
        if key not in got or got[key].shape != w.shape:
            what = "missing" if key not in got else f"shape {list(got[key].shape)}, PyTorch's {list(w.shape)}"
            r.update(error=f"{precision}: {key} {what}", rel_l2=None, agree=None)
            r["pass"] = False
            return r
        worst = max(worst, rel_l2(got[key], w))
        if w.ndim >= 2 and w.shape[1] > 1:
            agree = min(agree, agreement(got[key], w))
    r["rel_l2"], r["agree"] = worst, agree
    k = kind(name)
    need = {"classifier": 1.0, "segmentation": argmax_agree, "detection": 0.0}[k]
    r["pass"] = worst <= BOUNDS[precision] and (precision != "fp16" or agree >= need)
    if not r["pass"]:
        r["error"] = f"{precision}: rel L2 {worst:.1e} (bound {BOUNDS[precision]:.0e}), agreement {100 * agree:.2f}%"
        if k == "classifier" and agree < 1.0:
            r["error"] += f" ({margins(got, want)})"
    return r


def margins(got: dict, want: dict) -> str:
    """For the images whose top-1 differs: PyTorch's gap between its top two logits, as a share of
    the logits' standard deviation (random weights can leave two classes nearly tied)."""
    text = []
    for key, w in want.items():
        if not key.startswith("output.") or w.ndim != 2:
            continue
        for i in np.nonzero(np.argmax(got[key], axis=1) != np.argmax(w, axis=1))[0]:
            top = np.sort(w[i])[::-1]
            text.append(f"image {i}: PyTorch's top-2 gap {100 * (top[0] - top[1]) / max(float(np.std(w[i])), 1e-30):.2g}% of the logits' std")
    return "; ".join(text)


def gpu_steps(kiln: Kiln, work: str, name: str, a) -> dict:
    """FP32 and FP16 checks, then `kiln build`, `kiln run` and `kiln bench` on the exported file."""
    path, tc = f"{work}/{name}.kiln.safetensors", f"{work}/{name}.timing-cache"
    out = {"fp32": compare(kiln, work, name, "fp32", a.argmax_agree), "fp16": compare(kiln, work, name, "fp16", a.argmax_agree,
                                                                                     extra=["--timing-cache", tc])}
    cache = ["--fp16", "--timing-cache", tc]
    engine = f"{work}/{name}.kiln"
    steps = {
        "build": ["build", path, *cache, "-o", engine],
        "run": ["run", path, *cache, "--seed", "0"],
        "bench": ["bench", path, *cache, "--batch", "1", "--duration", "0.05", "--warmup", "20", "--json", f"{work}/{name}.bench.json"],
    }
    for step, args in steps.items():
        rc, text, s = kiln(args)
        # `kiln run` falls back to the CPU executor without a GPU: that is no engine run.
        cpu = step == "run" and "note: no GPU" in text
        out[step] = {"pass": rc == 0 and not cpu, "s": round(s, 1)}
        if rc != 0 or cpu:
            out[step]["error"] = f"kiln {step}: {last_line(text, rc)}"
        if step == "bench" and rc == 0:
            try:
                out[step]["ms"] = json.load(open(f"{work}/{name}.bench.json"))[0]["median_ms"]
            except (OSError, ValueError, LookupError):
                pass
    if os.path.exists(engine):
        os.remove(engine)
    return out


# ---- step 3: the segmentation benchmark ---------------------------------------------------------


def bench_kiln(kiln: Kiln, work: str, name: str, batches, seconds) -> tuple[list, str]:
    js = f"{work}/{name}.bench16.json"
    rc, text, _ = kiln(["bench", f"{work}/{name}.kiln.safetensors", "--fp16", "--cuda-graphs-only", "--batch", ",".join(map(str, batches)),
                        "--duration", str(seconds), "--warmup", "100", "--timing-cache", f"{work}/{name}.timing-cache", "--json", js],
                       timeout=240)
    if rc != 0 or not os.path.exists(js):
        return [], last_line(text, rc)
    return json.load(open(js)), ""


def bench_torch(name: str, work: str, export_size: int | None, size: int, batches, seconds) -> tuple[dict, dict]:
    """PyTorch FP16, channels_last: its own error on the exported model's reference (the same
    weights, at the exported size: what FP16 costs PyTorch itself, beside Kiln's FP16 row), and in
    a CUDA graph at `size`, {batch: (median ms, runs) or an error}."""
    import torch

    import bench_torch as bt

    torch.backends.cudnn.benchmark = True
    model, _ = build(name, export_size)
    fidelity = {}
    try:
        m = model.half().cuda().to(memory_format=torch.channels_last)
    except (RuntimeError, AssertionError) as e:  # no GPU for PyTorch: every row says why
        return {}, {b: f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}" for b in batches}
    try:
        ref = read(f"{work}/{name}.reference.safetensors")
        x = torch.from_numpy(ref["input.input"] if "input.input" in ref else ref["input"]).cuda().half().to(memory_format=torch.channels_last)
        with torch.no_grad():
            got = m(x)["out"].float().cpu().numpy()
        want = ref["output.out"]
        fidelity = {"rel_l2": rel_l2(got, want), "agree": agreement(got, want)}
    except Exception as e:  # noqa: BLE001 - the timing still runs
        fidelity = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    times = {}
    for b in batches:
        try:
            x = torch.rand([b, 3, size, size], device="cuda").half().to(memory_format=torch.channels_last)
            with torch.no_grad():
                fn = bt.graphed(lambda t: m(t)["out"], x)
                times[b] = bt.timed(fn, x, seconds, (20, 200))
            del fn, x
        except Exception as e:  # noqa: BLE001 - one batch's failure must not stop the others
            times[b] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        torch.cuda.empty_cache()
    del m, model
    torch.cuda.empty_cache()
    return fidelity, times


def benchmark(kiln: Kiln, work: str, names, a) -> tuple[list, list, dict]:
    """bench_all.py's units and rows for the segmentation models (kind `segmentation`), and
    PyTorch FP16's own error per model."""
    units, rows, fidelity = [], [], {}
    for name in names:
        size = int(a.bench_size)
        units.append(dict(name=name, model=name, kind="segmentation", size=size, kiln_batches=list(a.bench_batches),
                          cases=[["graph-fp16", b] for b in a.bench_batches], kiln_extra=[], flagship=[], zoo=[], weights_out=None))
        records, error = bench_kiln(kiln, work, name, a.bench_batches, a.bench_s)
        seen = set()
        for r in records:
            seen.add(r["batch"])
            rows.append(dict(model=name, peer="kiln-fp16", batch=r["batch"], status="ok", ms=r["median_ms"], img_s=r["batch"] / r["median_ms"] * 1e3,
                             p99_ms=r.get("p99_ms"), runs=r.get("iterations"), build_s=r.get("build_seconds"), cudnn=r.get("cudnn_version")))
        rows += [dict(model=name, peer="kiln-fp16", batch=b, status=f"failed: {error}") for b in a.bench_batches if b not in seen]
        fidelity[name], times = bench_torch(name, work, a.size, size, a.bench_batches, a.bench_s)
        for b, t in times.items():
            if isinstance(t, str):
                rows.append(dict(model=name, peer="graph-fp16", batch=b, status=t))
            else:
                rows.append(dict(model=name, peer="graph-fp16", batch=b, status="ok", ms=t[0], img_s=b / t[0] * 1e3, runs=t[1]))
        for r in rows[-2 * len(a.bench_batches):]:
            print(f"bench {r['model']:30s} {r['peer']:10s} b={r['batch']:<3d} " + (f"{r['ms']:8.3f} ms" if r["status"] == "ok" else r["status"]), flush=True)
        print(f"PyTorch FP16 {name}: {fidelity_text(fidelity[name])}", flush=True)
    return units, rows, fidelity


def fidelity_text(f: dict) -> str:
    if "rel_l2" not in f:
        return f.get("error", "not measured")
    return f"rel L2 {f['rel_l2']:.1e}, argmax {100 * f['agree']:.4g}%"


# ---- the table ----------------------------------------------------------------------------------


def verdict(row: dict, precisions) -> bool:
    steps = [*precisions] + (["build", "run", "bench"] if "fp32" in precisions else [])
    return "error" not in row.get("export", {}) and all(row.get(s, {}).get("pass") for s in steps)


def cell_l2(r: dict | None, seg_or_top1: str) -> str:
    if not r:
        return "-"
    if r.get("rel_l2") is None:
        return "error"
    text = f"{r['rel_l2']:.1e}"
    if seg_or_top1 and r.get("agree") is not None and seg_or_top1 != "detection":
        text += f" ({'top-1' if seg_or_top1 == 'classifier' else 'argmax'} {100 * r['agree']:.4g}%)"
    return text


def table(rows: list[dict], precisions) -> list[str]:
    head = ["model", "input"] + [{"cpu": "CPU rel L2 (≤ 1e-5)", "fp32": "FP32 rel L2 (≤ 1e-4)", "fp16": "FP16 rel L2 (≤ 1e-2)"}[p] for p in precisions]
    gpu = precisions != ["cpu"]
    head += ["layers (bundled)"] + (["build / run / bench (b1 ms)"] if gpu else []) + ["verdict", "note"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        e = r["export"]
        cells = [r["model"], e.get("input", "-")]
        cells += [cell_l2(r.get(p), r["kind"] if p == "fp16" else "") for p in precisions]
        ops = "-" if e.get("ops") is None else str(e["ops"])
        if e.get("bundled_ops") is not None:
            ops += f" ({e['bundled_ops']})"
        cells.append(ops)
        if gpu:
            marks = ["ok" if r.get(s, {}).get("pass") else ("FAIL" if s in r else "-") for s in ("build", "run", "bench")]
            ms = r.get("bench", {}).get("ms")
            cells.append(" / ".join(marks) + (f" ({ms:.3f})" if ms else ""))
        cells.append("pass" if r.get("pass") else "FAIL")
        notes = [v["error"] for k, v in r.items() if isinstance(v, dict) and v.get("error") and k != "torch_fp16"]
        if r["kind"] == "detection" and "fp16" in r:
            notes.append("FP16 judged by rel L2 (random weights tie the class scores)")
        if r.get("torch_fp16"):
            notes.append(f"PyTorch's own FP16: {fidelity_text(r['torch_fp16'])}")
        cells.append("; ".join(notes).replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def bench_table(units: list, rows: list, device: str) -> list[str]:
    ix = {(r["model"], r["peer"], r["batch"]): r for r in rows}
    lines = [f"Segmentation at {units[0]['size']}×{units[0]['size']}, FP16, CUDA graphs, median ms ({device}); ratio = PyTorch / Kiln.", "",
             "| model | batch | Kiln FP16 | PyTorch FP16 + CUDA graph | ratio |", "|---|---|---|---|---|"]
    for u in units:
        for b in u["kiln_batches"]:
            k, t = ix.get((u["model"], "kiln-fp16", b)), ix.get((u["model"], "graph-fp16", b))
            ok = lambda r: r is not None and r["status"] == "ok"  # noqa: E731
            fmt = lambda r: f"{r['ms']:.3f}" if ok(r) else (r["status"] if r else "-")  # noqa: E731
            ratio = f"{t['ms'] / k['ms']:.2f}" if ok(k) and ok(t) else "-"
            lines.append(f"| {u['model']} | {b} | {fmt(k)} | {fmt(t)} | {ratio} |")
    return lines


def machine(kiln_bin: str) -> dict:
    v = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        o = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30).stdout
        v["gpu"], v["driver"], v["gpu_memory"] = [p.strip() for p in o.splitlines()[0].split(",")]
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        v["gpu"] = "CPU"
    commit = os.path.join(os.path.dirname(kiln_bin), "COMMIT")
    v["kiln_commit"] = open(commit).read().strip() if os.path.exists(commit) else "?"
    return v


# ---- main ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help=f"models or groups ({', '.join(GROUPS)}); default: all")
    p.add_argument("--kiln", default="target/release/kiln")
    p.add_argument("--out", default="/tmp/torch-engine-check")
    p.add_argument("--work", default=None, help="where the graph files go (default: a folder under /tmp)")
    p.add_argument("--cpu", action="store_true", help="the CPU executor only (no GPU needed)")
    p.add_argument("--size", type=int, default=None, help="segmentation input size instead of 520 (CPU shake-outs)")
    p.add_argument("--jobs", type=int, default=max(1, min(6, (os.cpu_count() or 2) // 2)), help="export processes")
    p.add_argument("--threads", type=int, default=2, help="torch threads per export process")
    p.add_argument("--cpu-jobs", type=int, default=3, help="`kiln compare --cpu` at a time")
    p.add_argument("--cpu-threads", type=int, default=4, help="CPU executor threads per compare (MATMUL_NUM_THREADS)")
    p.add_argument("--gpu-lanes", type=int, default=3, help="models checked on the GPU at a time")
    p.add_argument("--bench", action="store_true", help="then time the segmentation models against PyTorch")
    p.add_argument("--bench-batches", default="1,16", type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--bench-size", type=int, default=520)
    p.add_argument("--bench-s", type=float, default=0.3, help="seconds of timed calls per model and batch, each side")
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole run: GPU checks that would start too late "
                   "to leave the benchmark its time are reported as not run")
    p.add_argument("--argmax-agree", type=float, default=0.99, help="FP16 segmentation: least fraction of pixels whose argmax agrees")
    a = p.parse_args()
    t0 = time.time()
    precisions = ["cpu"] if a.cpu else ["cpu", "fp32", "fp16"]
    names = []
    for n in a.models or ["all"]:
        names += [m for m in GROUPS.get(n, [n]) if m not in names]
    order = [n for n in HEAVY if n in names] + [n for n in names if n not in HEAVY]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = a.work or f"/tmp/kiln-torch-check-{os.getpid()}"
    os.makedirs(work, exist_ok=True)
    # Kernels compiled once per machine, shared with tools/bench_all.py's runs.
    kiln = Kiln(a.kiln, out / "kiln.log", os.environ.get("KILN_CACHE_DIR") or "/tmp/kiln-bench-cache/kiln")
    kiln.deadline = t0 + a.budget
    gpu = not a.cpu
    info = machine(a.kiln) if gpu else {"gpu": "CPU", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    device = info["gpu"]
    print(f"{len(order)} models on {device}: {' '.join(order)}", flush=True)

    rows = {n: {"model": n, "kind": kind(n)} for n in order}
    gpu_queue: queue.Queue = queue.Queue()
    warm = threading.Event()
    phases = {}

    def warm_up():
        # Fills the kernel cache once (NVRTC compiles every family on a fresh machine) before
        # the lanes build engines side by side.
        rc, text, s = kiln(["run", "resnet18", "--fp16", "--seed", "0"])
        phases["warm_up_s"] = round(s, 1)
        print(f"warm-up (kernel cache): {s:.1f} s, exit {rc}", flush=True)
        warm.set()

    # What the benchmark needs at the end; a model whose GPU checks would start later is reported
    # as not run, so that the tables come back within the device call.
    bench_reserve = 100 if a.bench and gpu else 0

    def lane():
        warm.wait()
        while (name := gpu_queue.get()) is not None:
            if time.time() - t0 > a.budget - bench_reserve - 20:
                rows[name]["fp32"] = {"error": "GPU checks not run (time: --budget)", "pass": False}
            else:
                rows[name].update(gpu_steps(kiln, work, name, a))
            done(name, "gpu")

    finished: dict = {n: set() for n in order}
    report_lock = threading.Lock()

    def done(name: str, part: str):
        with report_lock:
            finished[name].add(part)
            r = rows[name]
            need = {"export", "cpu"} | ({"gpu"} if gpu else set())
            if "error" in r.get("export", {}):
                need = {"export"}
            if need <= finished[name]:
                r["pass"] = verdict(r, precisions)
                print(table([r], precisions)[-1], f"[{time.time() - t0:.0f} s]", flush=True)

    threads = []
    if gpu:
        threads.append(threading.Thread(target=warm_up))
        threads += [threading.Thread(target=lane) for _ in range(a.gpu_lanes)]
        for t in threads:
            t.start()
    cpu_pool = cf.ThreadPoolExecutor(a.cpu_jobs)

    def cpu_check(name):
        rows[name]["cpu"] = compare(kiln, work, name, "cpu", a.argmax_agree, threads=a.cpu_threads)
        done(name, "cpu")

    ctx = multiprocessing.get_context("spawn")
    cpu_futures = []
    with cf.ProcessPoolExecutor(a.jobs, mp_context=ctx) as pool:
        futures = {pool.submit(export_one, n, work, a.kiln, a.threads, a.size): n for n in order}
        for f in cf.as_completed(futures):
            name = futures[f]
            try:
                rows[name]["export"] = f.result()
            except Exception as e:  # noqa: BLE001 - a crashed worker is one model's failure
                rows[name]["export"] = {"error": f"export: {type(e).__name__}: {e}"}
            e = rows[name]["export"]
            what = e.get("error") or f"{e.get('export_s')} s, {e.get('ops')} layers"
            print(f"exported {name}: {what} [{time.time() - t0:.0f} s]", flush=True)
            if "error" in e:
                done(name, "export")
                continue
            done(name, "export")
            cpu_futures.append(cpu_pool.submit(cpu_check, name))
            if gpu:
                gpu_queue.put(name)
    phases["export_s"] = round(time.time() - t0, 1)
    for _ in range(a.gpu_lanes if gpu else 0):
        gpu_queue.put(None)
    for f in cpu_futures:
        f.result()
    cpu_pool.shutdown()
    for t in threads:
        t.join()
    phases["check_s"] = round(time.time() - t0, 1)

    check_rows = [rows[n] for n in names]
    units, bench_rows = [], []
    if a.bench and gpu and time.time() - t0 > a.budget - 60:
        print(f"benchmark skipped: {time.time() - t0:.0f} s of the {a.budget:.0f} s budget spent", flush=True)
    elif a.bench and gpu:
        seg = [n for n in names if kind(n) == "segmentation" and "error" not in rows[n].get("export", {})]
        tb = time.time()
        units, bench_rows, fidelity = benchmark(kiln, work, seg, a)
        for n, f in fidelity.items():
            rows[n]["torch_fp16"] = f
            # A segmentation map's argmax bar is PyTorch's own FP16 agreement where that is lower:
            # Kiln's FP16 should lose no more than PyTorch's does (same weights, same input).
            fp16 = rows[n].get("fp16", {})
            if (not fp16.get("pass") and fp16.get("rel_l2") is not None and fp16["rel_l2"] <= BOUNDS["fp16"]
                    and f.get("agree") is not None and fp16.get("agree", 0.0) >= f["agree"]):
                fp16["pass"] = True
                fp16.pop("error", None)
                rows[n]["pass"] = verdict(rows[n], precisions)
        phases["bench_s"] = round(time.time() - tb, 1)
    lines = [f"kiln-torch device check on {device} ({info['date']}, kiln {info.get('kiln_commit', '?')}): {len(names)} models, "
             f"{sum(1 for r in check_rows if r.get('pass'))} pass", ""] + table(check_rows, precisions)
    if units:
        lines += [""] + bench_table(units, bench_rows, device)
    phases["total_s"] = round(time.time() - t0, 1)
    lines += ["", "Seconds: " + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f}" for k, v in phases.items())]
    versions = dict(info)
    try:
        import torch
        import torchvision

        versions.update(torch=torch.__version__, torch_cuda=torch.version.cuda, torchvision=torchvision.__version__)
        if gpu and torch.cuda.is_available():
            versions["torch_cudnn"] = torch.backends.cudnn.version()
    except ImportError:
        pass
    versions.update({"kiln_cudnn": r["cudnn"] for r in bench_rows if r.get("cudnn")})
    command = "bash tools/torch-engine-check.sh" + ("" if not a.models else " " + " ".join(a.models))
    result = dict(command=command, tables=["segmentation"], budget_s=a.budget, versions=versions, phases=phases, units=units, rows=bench_rows, check=check_rows,
                  wall_s=phases["total_s"])
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines), flush=True)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if check_rows and all(r.get("pass") for r in check_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
