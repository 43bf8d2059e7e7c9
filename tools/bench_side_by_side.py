#!/usr/bin/env python3
"""Kiln beside the PyTorch peers, measured in one device run, written up as docs/BENCHMARKS.md.

Three steps (the device has no cargo; see ../shared/GPU.md):

  1. here:    python3 tools/bench_side_by_side.py prepare
              builds `kiln` (release) and copies it and torch_peer.py into .carry/
  2. device:  python3 tools/bench_side_by_side.py device
              (device tool: carry [".carry"]; results, the table and the chart land in $OUT)
  3. here:    python3 tools/bench_side_by_side.py render <the device run's files_at>/results.json
              writes docs/BENCHMARKS.md and docs/benchmarks.svg from it, and keeps it as docs/benchmarks.json

`device` runs, within --budget seconds: `kiln bench` FP16 (with and without CUDA graphs) and FP32
on ResNet-18/50 at batch 1, 8, 64, 256 and CenterNet-R50 (512) at 1, 8, 32; then torch_peer.py's
eager peers (FP32, FP16 channels_last, FP16 + CUDA graph) on the same models and batches; then
torch.compile (reduce-overhead) on COMPILE_SET. Every step writes JSON as it goes, so a step cut
short by the budget still leaves the others' numbers. The chart is drawn by this script (plain SVG).
"""

import argparse
import datetime
import glob
import html
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

PLANS = [("resnet18", 224, [1, 8, 64, 256]), ("resnet50", 224, [1, 8, 64, 256]), ("centernet", 512, [1, 8, 32])]
LIBS = "/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib"
DEFAULT_COMPILE_SET = "resnet18:1,resnet18:256,resnet50:1,resnet50:64,resnet50:256,centernet:1,centernet:32"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Series of the table and the chart: (key, label, colour). Kiln's keys are precision/mode.
SERIES = [
    ("kiln fp16 cuda-graph", "Kiln FP16 (CUDA graph)", "#d62828"),
    ("kiln fp16 no-graph", "Kiln FP16 (no graph)", "#f77f00"),
    ("kiln fp32 cuda-graph", "Kiln FP32 (CUDA graph)", "#fcbf49"),
    ("eager fp32 (cudnn tf32 on)", "PyTorch eager FP32 (TF32 on)", "#6c757d"),
    ("eager fp16 channels_last", "PyTorch eager FP16 channels_last", "#457b9d"),
    ("cudagraph fp16 channels_last", "PyTorch FP16 + CUDA graph", "#1d3557"),
    ("compile reduce-overhead fp16", "torch.compile FP16 (reduce-overhead)", "#2a9d8f"),
]
PEERS = [s for s in SERIES if not s[0].startswith("kiln")]
# A line torch_peer.py prints per measurement: `resnet18   eager fp16 channels_last   b=8    224px    0.512 ms    15625 img/s`.
PEER_LINE = re.compile(r"^(?P<model>\S+)\s+(?P<mode>.+?)\s+b=(?P<batch>\d+)\s+\d+px\s+(?P<ms>[\d.]+) ms\s+(?P<img_s>[\d.]+) img/s")


def sh(cmd, timeout=None, env=None, log=None):
    """Runs cmd, echoing and optionally logging its output; returns (returncode, output)."""
    print("+", " ".join(cmd), flush=True)
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)
        out, rc = p.stdout, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "") + f"\n[timed out after {timeout:.0f} s]\n"
        rc = 124
    except FileNotFoundError as e:
        out, rc = str(e), 127
    print(out, flush=True)
    if log:
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n" + out + "\n")
    return rc, out


# ---- step 1: prepare (here) ---------------------------------------------------------------------


def prepare(args):
    carry = os.path.join(ROOT, ".carry")
    os.makedirs(carry, exist_ok=True)
    rc, _ = sh(["cargo", "build", "--release", "-p", "kiln-models", "--bin", "kiln"])
    if rc != 0:
        sys.exit("cargo build failed")
    exe = os.path.join(carry, "kiln")
    shutil.copy2(os.path.join(ROOT, "target", "release", "kiln"), exe)
    sh(["strip", exe])  # the carry limit is 64 MiB for everything
    shutil.copy2(args.peer, os.path.join(carry, "torch_peer.py"))
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(carry, "*")) if os.path.isfile(p))
    print(f"ready: .carry/ holds kiln and torch_peer.py ({size / 2**20:.1f} MiB of the 64 MiB carry limit)")
    print('next, on the device with carry [".carry"]:  python3 tools/bench_side_by_side.py device')


# ---- step 2: device -----------------------------------------------------------------------------


def versions(out_dir, torch_env):
    v = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    rc, o = sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if rc == 0 and o.strip():
        parts = [p.strip() for p in o.strip().splitlines()[0].split(",")]
        v["gpu"], v["driver"], v["gpu_memory"] = parts[0], parts[1], parts[2] if len(parts) > 2 else ""
    rc, o = sh(["nvcc", "--version"])
    if rc != 0:
        rc, o = sh(["/usr/local/cuda/bin/nvcc", "--version"])
    release = [line for line in o.splitlines() if "release" in line]
    if rc == 0 and release:
        v["cuda"] = release[0].split("release", 1)[1].strip()
    code = "import torch, torchvision; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torchvision.__version__)"
    rc, o = sh([sys.executable, "-c", code], env=torch_env)
    if rc == 0 and o.strip():
        t, cuda, cudnn, tv = o.strip().splitlines()[-1].split()
        v.update(torch=t, torch_cuda=cuda, torch_cudnn=cudnn, torchvision=tv)
    with open(os.path.join(out_dir, "versions.json"), "w") as f:
        json.dump(v, f, indent=1)
    return v


def first_existing(given, candidates):
    """`given`, or the first of `candidates` (relative to the repository) that exists: tools/gpu-build.sh
    lays .carry/ out differently (bin/, tools/) and may have run after `prepare`."""
    if given:
        return given
    for c in candidates:
        path = os.path.join(ROOT, c)
        if os.path.exists(path):
            return path
    sys.exit(f"none of {candidates} exists: run `python3 tools/bench_side_by_side.py prepare` first")


def device(args):
    final = os.environ.get("OUT") or args.out
    os.makedirs(final, exist_ok=True)
    # The device tool brings back only a few files from $OUT: measure in a scratch folder, then
    # leave there one results.json with every number, the write-up, the chart and the log.
    out = tempfile.mkdtemp(prefix="kiln-side-by-side-")
    log = os.path.join(final, "side_by_side.log")
    start = time.time()
    left = lambda: args.budget - (time.time() - start)  # noqa: E731
    # Kiln needs the system cuDNN and CUDA 13 libraries on the path; PyTorch must not see them (it
    # bundles a newer cuDNN and refuses an older one found first), so only kiln gets them.
    torch_env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    torch_env["PYTHONUNBUFFERED"] = "1"
    env = dict(torch_env, LD_LIBRARY_PATH=LIBS)
    versions(out, torch_env)
    kiln = os.path.abspath(first_existing(args.kiln, [".carry/kiln", ".carry/bin/kiln"]))
    args.peer = first_existing(args.peer, [".carry/torch_peer.py", ".carry/tools/torch_peer.py"])

    def kiln_bench(precision, both_modes):
        for model, size, batches in PLANS:
            if left() < 30:
                print(f"budget spent: skipping kiln {precision} {model}", flush=True)
                return
            cmd = [kiln, "bench", model, f"--{precision}", "--batch", ",".join(map(str, batches)), "--iterations", str(args.iterations)]
            cmd += ["--duration", str(args.duration), "--timing-cache", os.path.join(out, "timing_cache.json")]
            cmd += ["--json", os.path.join(out, f"kiln_{model}_{precision}.json")]
            if not both_modes:
                cmd.append("--cuda-graphs-only")
            sh(cmd, timeout=left() - 20, env=env, log=log)

    def peer(kind, extra):
        if left() < 60:
            print(f"budget spent: skipping PyTorch {kind}", flush=True)
            return
        d = os.path.join(out, f"peer_{kind}")
        os.makedirs(d, exist_ok=True)
        e = dict(torch_env, OUT=d, **extra)
        _, output = sh([sys.executable, args.peer], timeout=left() - 20, env=e, log=log)
        # torch_peer.py writes its JSON at the end; its printed lines survive a run cut short.
        with open(os.path.join(d, "stdout.log"), "w") as f:
            f.write(output)

    kiln_bench("fp16", both_modes=True)
    peer("eager", {"EAGER": "1", "COMPILE": "0"})
    kiln_bench("fp32", both_modes=False)
    if args.compile_set:
        peer("compile", {"EAGER": "0", "COMPILE": "1", "COMPILE_SET": args.compile_set})
    bundle(out, os.path.join(final, "results.json"))
    render_to(final, final, command=args.command)
    print(f"done in {time.time() - start:.0f} s; results in {final}")


def bundle(scratch, path):
    """Every measurement and the versions in one file (what `render` reads)."""
    data = {"versions": {}, "kiln": [], "peers": [], "peer_logs": {}}
    vpath = os.path.join(scratch, "versions.json")
    if os.path.exists(vpath):
        data["versions"] = json.load(open(vpath))
    for p in sorted(glob.glob(os.path.join(scratch, "kiln_*.json"))):
        data["kiln"] += json.load(open(p))
    for d in sorted(glob.glob(os.path.join(scratch, "peer_*"))):
        for p in sorted(glob.glob(os.path.join(d, "*.json"))):
            data["peers"] += json.load(open(p))
        log = os.path.join(d, "stdout.log")
        if os.path.exists(log):
            data["peer_logs"][os.path.basename(d)] = open(log).read()
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


# ---- step 3: render -----------------------------------------------------------------------------


def load(results):
    """Rows {(model, batch, series): {ms, img_s}} from a results.json (or the folder holding it);
    a peer run cut short before writing its JSON is read from its printed lines."""
    path = results if results.endswith(".json") else os.path.join(results, "results.json")
    data = json.load(open(path))
    rows = {}
    for r in data["kiln"]:
        key = f"kiln {r['precision']} {r['mode']}"
        rows[(r["model"], r["batch"], key)] = dict(ms=r["median_ms"], p99=r["p99_ms"], img_s=r["batch"] / r["median_ms"] * 1e3, kiln=r)
    for text in data.get("peer_logs", {}).values():
        for line in text.splitlines():
            m = PEER_LINE.match(line)
            if m:
                rows[(m["model"], int(m["batch"]), m["mode"].strip())] = dict(ms=float(m["ms"]), img_s=float(m["img_s"]))
    for r in data["peers"]:
        rows[(r["model"], r["batch"], r["mode"])] = dict(ms=r["ms"], img_s=r["img_s"])
    return rows, data.get("versions", {})


def fmt_ms(v):
    return "–" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def fmt_rate(v):
    return "–" if v is None else (f"{v / 1000:.1f} k" if v >= 1000 else f"{v:.0f}")


def table(rows):
    lines = []
    head = ["model", "batch"] + [label for _, label, _ in SERIES]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for model, size, batches in PLANS:
        for b in batches:
            cells = [f"{model} ({size})", str(b)]
            for key, _, _ in SERIES:
                r = rows.get((model, b, key))
                cells.append("–" if r is None else f"{fmt_ms(r['ms'])} ms / {fmt_rate(r['img_s'])}/s")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(rows):
    """Kiln FP16 (CUDA graph) speed-up over each peer: peer time / Kiln time (> 1: Kiln is faster)."""
    lines = ["| model | batch | Kiln FP16 | " + " | ".join(f"vs {label}" for _, label, _ in PEERS) + " |"]
    lines.append("|" + "---|" * (3 + len(PEERS)))
    for model, size, batches in PLANS:
        for b in batches:
            k = rows.get((model, b, "kiln fp16 cuda-graph"))
            cells = [model, str(b), "–" if k is None else f"{fmt_ms(k['ms'])} ms"]
            for key, _, _ in PEERS:
                p = rows.get((model, b, key))
                cells.append("–" if (k is None or p is None) else f"{p['ms'] / k['ms']:.2f}×")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def svg_chart(rows):
    """Images/s by batch size, one panel per model, log-log axes, one line per series."""
    pw, ph, ml, mr, mt, mb = 330, 260, 62, 14, 34, 44
    legend_h = 22 * math.ceil(len(SERIES) / 2) + 10
    width, height = 3 * pw, ph + legend_h
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">']
    o.append(f'<rect width="{width}" height="{height}" fill="white"/>')
    for i, (model, size, batches) in enumerate(PLANS):
        x0 = i * pw
        vals = [r["img_s"] for (m, b, _), r in rows.items() if m == model and r.get("img_s")]
        if not vals:
            vals = [1, 10]
        lo = 10 ** math.floor(math.log10(min(vals)))
        hi = 10 ** math.ceil(math.log10(max(vals)))
        if hi <= lo:
            hi = lo * 10
        bx0, bx1 = math.log2(batches[0]), math.log2(batches[-1])
        X = lambda b: x0 + ml + (math.log2(b) - bx0) / max(bx1 - bx0, 1e-9) * (pw - ml - mr)  # noqa: E731
        Y = lambda v: mt + (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))) * (ph - mt - mb)  # noqa: E731
        o.append(f'<text x="{x0 + pw / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{html.escape(model)} ({size}×{size})</text>')
        o.append(f'<rect x="{x0 + ml}" y="{mt}" width="{pw - ml - mr}" height="{ph - mt - mb}" fill="none" stroke="#999"/>')
        e = int(math.log10(lo))
        while 10**e <= hi:
            y = Y(10**e)
            o.append(f'<line x1="{x0 + ml}" x2="{x0 + pw - mr}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e5e5e5"/>')
            tick = f"{10**e // 1000} k" if e >= 3 else str(10**e)
            o.append(f'<text x="{x0 + ml - 4}" y="{y + 4:.1f}" text-anchor="end">{tick}</text>')
            e += 1
        for b in batches:
            o.append(f'<text x="{X(b):.1f}" y="{ph - mb + 16}" text-anchor="middle">{b}</text>')
        o.append(f'<text x="{x0 + ml + (pw - ml - mr) / 2}" y="{ph - 8}" text-anchor="middle">batch size</text>')
        if i == 0:
            o.append(f'<text transform="translate(14 {mt + (ph - mt - mb) / 2}) rotate(-90)" text-anchor="middle">images/s (log)</text>')
        for key, _, colour in SERIES:
            pts = [(X(b), Y(rows[(model, b, key)]["img_s"])) for b in batches if (model, b, key) in rows]
            if len(pts) > 1:
                o.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in pts)}"/>')
            for x, y in pts:
                o.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
    for j, (_, label, colour) in enumerate(SERIES):
        lx, ly = 20 + (j % 2) * (width / 2), ph + 16 + 22 * (j // 2)
        o.append(f'<line x1="{lx}" x2="{lx + 24}" y1="{ly - 4}" y2="{ly - 4}" stroke="{colour}" stroke-width="3"/>')
        o.append(f'<text x="{lx + 30}" y="{ly}">{html.escape(label)}</text>')
    o.append("</svg>")
    return "\n".join(o) + "\n"


def render_to(results, out_dir, command=None):
    rows, v = load(results)
    kiln_rec = next((r["kiln"] for r in rows.values() if "kiln" in r), None)
    svg_name = "benchmarks.svg"
    with open(os.path.join(out_dir, svg_name), "w") as f:
        f.write(svg_chart(rows))
    env = [
        f"- GPU: {v.get('gpu', '?')} ({v.get('gpu_memory', '?')}), driver {v.get('driver', '?')}",
        f"- CUDA: {v.get('cuda', '?')}; PyTorch {v.get('torch', '?')} (CUDA {v.get('torch_cuda', '?')}, cuDNN {v.get('torch_cudnn', '?')}), torchvision {v.get('torchvision', '?')}",
    ]
    if kiln_rec:
        env.append(f"- Kiln: cuDNN {kiln_rec.get('cudnn_version', '?')} as loaded by the engine, CUDA driver API {kiln_rec.get('driver_version', '?')}")
    env.append(f"- Date: {v.get('date', '?')}")
    missing = [label for key, label, _ in SERIES if not any(k[2] == key for k in rows)]
    doc = f"""# Benchmarks: Kiln beside PyTorch

Measured in one device run by `tools/bench_side_by_side.py` (Kiln's `kiln bench` and
`../shared/bench/torch_peer.py` on the same GPU, one after the other). Random inputs; Kiln uses
its seeded weights, the peers torchvision's random initialisation (speed does not depend on the
values). Kiln: median latency of synchronous runs (enqueue + wait) after a 200 ms warm-up, engine
built for exactly that batch. Peers: median of 50 CUDA-event-timed runs after 10 warm-up runs.
Kiln FP32 is strict FP32 (no TF32 anywhere); PyTorch's eager FP32 lets cuDNN use TF32.

{chr(10).join(env)}

How to reproduce (three steps; the device has no cargo):
```sh
python3 tools/bench_side_by_side.py prepare            # here: build kiln, fill .carry/
python3 tools/bench_side_by_side.py device             # on the device, carry [".carry"]{f"  (this run: {command})" if command else ""}
python3 tools/bench_side_by_side.py render <files_at>/results.json  # here: rewrite this file and the chart
```
The criterion benches (`benches/models.rs`) measure the same engines: `cargo bench --bench models --no-run`
here, then the `target/release/deps/models-*` binary with `--bench` on the device.

## Kiln FP16 speed-up over each peer (peer time / Kiln time; above 1 means Kiln is faster)

{ratio_table(rows)}

## Latency and throughput (median ms / images per second)

{table(rows)}

![images/s by batch size]({svg_name})
"""
    if missing:
        doc += f"\nNot measured in this run: {', '.join(missing)}.\n"
    # The zoo section (tools/bench_zoo.py) stays above the flagships' tables: keep it, and write
    # this run's write-up as its "## The flagships" section.
    path = os.path.join(out_dir, "BENCHMARKS.md")
    zoo_marker, flagships = "## The model zoo", "## The flagships"
    old = open(path).read() if os.path.exists(path) else ""
    if zoo_marker in old and flagships in old:
        head = old[: old.index(flagships)]
        body = doc.split("\n", 1)[1].lstrip("\n")
        doc = f"{head}{flagships} (this run)\n\n{body}"
    with open(path, "w") as f:
        f.write(doc)
    print(f"wrote {os.path.join(out_dir, 'BENCHMARKS.md')} and {svg_name} ({len(rows)} measurements)")


def render(args):
    out = os.path.join(ROOT, "docs")
    os.makedirs(out, exist_ok=True)
    results = args.results if args.results.endswith(".json") else os.path.join(args.results, "results.json")
    # The raw numbers go beside the write-up, so it can be rendered again.
    kept = os.path.join(out, "benchmarks.json")
    if os.path.abspath(results) != os.path.abspath(kept):
        shutil.copyfile(results, kept)
    render_to(kept, out, command=args.command)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    a = sub.add_parser("prepare", help="build kiln here and fill .carry/")
    a.add_argument("--peer", default=os.path.join(ROOT, "..", "shared", "bench", "torch_peer.py"))
    a.set_defaults(fn=prepare)
    d = sub.add_parser("device", help="run both benchmarks on the device; results in $OUT")
    d.add_argument("--kiln", help="the kiln binary (default: .carry/kiln or .carry/bin/kiln)")
    d.add_argument("--peer", help="torch_peer.py (default: .carry/torch_peer.py or .carry/tools/torch_peer.py)")
    d.add_argument("--out", default="bench_out", help="results folder when $OUT is not set")
    d.add_argument("--budget", type=float, default=560, help="seconds for the whole run (the device allows 600 per command)")
    d.add_argument("--iterations", type=int, default=50)
    d.add_argument("--duration", type=float, default=0.5, help="minimum timed seconds per (model, batch, mode)")
    d.add_argument("--compile-set", default=DEFAULT_COMPILE_SET, help="model:batch pairs for torch.compile ('' to skip)")
    d.add_argument("--command", default="python3 tools/bench_side_by_side.py device")
    d.set_defaults(fn=device)
    r = sub.add_parser("render", help="write docs/BENCHMARKS.md and docs/benchmarks.svg from a device run's results.json")
    r.add_argument("results")
    r.add_argument("--command", default=None)
    r.set_defaults(fn=render)
    args = p.parse_args()
    args.fn(args)


if __name__ == "__main__":
    main()
