#!/usr/bin/env python3
"""The model zoo beside its PyTorch peers, and the regression check of the bundled models against an
older build (--old). docs/BENCHMARKS.md's tables now come from tools/bench_all.py; this script stays
for the regression check.

For every model: Kiln FP16 (CUDA graphs) at batch 1 (latency) and batch 64 (throughput) through
`kiln bench`, then torchvision's own model in FP16 channels_last with a CUDA graph at both batches
and, while the time budget lasts, torch.compile (reduce-overhead) at batch 64 and 1. With --old, the
same `kiln bench` runs through an older build too (a regression check in the same run, on the same
GPU, the two builds alternating and their order swapped each round): the flagships by default, or
with `--regress all` every bundled model at its batches (`regress_batches`); `--regress-only` skips
the zoo and its peers, and `--shard I/N` takes every N-th model from the I-th (one process per GPU,
each with its own CUDA_VISIBLE_DEVICES). Random weights on both sides; ratios, not absolute times,
are what to quote.

  here:    cargo build --release -p kiln-cli --bin kiln && cp target/release/kiln .carry/bin/
  device:  python3 .carry/tools/bench_zoo.py --kiln .carry/bin/kiln --out $OUT [--old .carry/bin/kiln-old]
  here:    python3 tools/bench_zoo.py --render <files_at>/zoo.json [more zoo.json ...]   (the markdown tables)
"""

import argparse
import json
import os
import subprocess
import sys
import time

import bundled
from bench_torch import graphed  # tools/ is the script directory, so its modules import

LIBS = "/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib"
# (model, batch) pairs the regression check times with the old and the new build, alternating.
REGRESSION = [("resnet50", 1), ("resnet50", 256), ("centernet", 32)]


def regress_batches(model):
    """The batches `--regress all` times a bundled model at (a dict from `kiln models --json`): the
    flagship ResNets at 1, 64 and 256, the detectors at 1 and 32, every other classifier at 1 and 64."""
    if model["name"] in ("resnet18", "resnet50"):
        return [1, 64, 256]
    return [1, 32] if model["family"] in ("centernet", "yolo") else [1, 64]


def regression_plan(args):
    """(model, batches) for the regression check: `--regress` flagships, all, or a list of names."""
    if args.regress == "flagships":
        plan = [(m, [b]) for m, b in REGRESSION]
    else:
        listed = bundled.models(args.kiln)
        wanted = None if args.regress == "all" else set(args.regress.split(","))
        plan = [(m["name"], regress_batches(m)) for m in listed if wanted is None or m["name"] in wanted]
    i, n = (int(v) for v in args.shard.split("/"))
    return plan[i::n]


def kiln_bench(exe, model, batches, out_json, duration, extra=(), warmup_ms=200):
    """`kiln bench` of `model` (FP16, CUDA graphs) at `batches`, its JSON records."""
    env = dict(os.environ, LD_LIBRARY_PATH=LIBS)
    cmd = [exe, "bench", model, *extra, "--fp16", "--cuda-graphs-only", "--batch", ",".join(map(str, batches)), "--duration", str(duration),
           "--warmup", str(warmup_ms), "--json", out_json]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    print(p.stdout[-2000:], flush=True)
    if p.returncode != 0 or not os.path.exists(out_json):
        return []
    with open(out_json) as f:
        return json.load(f)


def timed(fn, x, iters):
    """Median CUDA-event time of `fn(x)` in ms, after 5 warm-up calls."""
    import torch

    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(x)
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def torch_peers(model, deadline, compile_batches):
    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True
    kwargs = {"aux_logits": False, "init_weights": True} if model == "googlenet" else {}
    m = getattr(torchvision.models, model)(weights=None, **kwargs).eval().cuda().half().to(memory_format=torch.channels_last)

    rows = []
    with torch.inference_mode():
        for b in (1, 64):
            x = torch.randn(b, 3, 224, 224, device="cuda").half().to(memory_format=torch.channels_last)
            ms = timed(graphed(m, x), x, 100 if b == 1 else 30)
            rows.append(dict(model=model, peer="torch fp16 cuda-graph", batch=b, ms=ms, img_s=b / ms * 1e3))
        for b in compile_batches:
            if time.time() > deadline:
                print(f"{model}: torch.compile at batch {b} skipped (time budget)", flush=True)
                continue
            torch._dynamo.reset()
            c = torch.compile(m, mode="reduce-overhead")
            x = torch.randn(b, 3, 224, 224, device="cuda").half().to(memory_format=torch.channels_last)
            ms = timed(lambda t: c(t).clone(), x, 100 if b == 1 else 30)
            rows.append(dict(model=model, peer="torch.compile reduce-overhead", batch=b, ms=ms, img_s=b / ms * 1e3))
    for r in rows:
        print(f"{r['model']:18s} {r['peer']:30s} b={r['batch']:<3d} {r['ms']:8.3f} ms {r['img_s']:10.0f} img/s", flush=True)
    return rows


def device(args):
    os.makedirs(args.out, exist_ok=True)
    result = {"kiln": [], "peers": [], "regression": []}
    path = os.path.join(args.out, "zoo.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    start = time.time()
    if args.old:
        plan = regression_plan(args)
        for rnd in range(args.rounds):
            for model, batches in plan:
                builds = [("old", args.old), ("new", args.kiln)]
                for label, exe in builds if rnd % 2 == 0 else builds[::-1]:
                    # Each build keeps its own timing cache: the second round skips the tactic timing.
                    cache = ("--timing-cache", os.path.join(args.out, f"timing_{label}.cache"))
                    recs = kiln_bench(exe, model, batches, os.path.join(args.out, f"reg_{label}.json"), args.duration, cache)
                    if not recs:
                        print(f"REGRESSION {model} {label}: no result", flush=True)
                    result["regression"] += [dict(r, build=label, round=rnd) for r in recs]
                    save()
            print(f"regression round {rnd} done at {time.time() - start:.0f} s", flush=True)
    if args.regress_only:
        return
    # The zoo: every bundled model whose twin is torchvision's, as the kiln binary lists them.
    zoo = [m["name"] for m in bundled.models(args.kiln) if m["torchvision"]]
    models = [m for m in zoo if not args.models or m in args.models.split(",")]
    for model in models:
        result["kiln"] += kiln_bench(args.kiln, model, [1, 64], os.path.join(args.out, "kiln.json"), 1)
        save()
    deadline = start + args.budget
    for model in models:
        batches = [int(b) for b in args.compile_batches.split(",") if b] if args.compile else []
        result["peers"] += torch_peers(model, deadline, batches)
        save()
    print(f"zoo done in {time.time() - start:.0f} s", flush=True)


def render(paths):
    r = {"kiln": [], "peers": [], "regression": []}
    for path in paths:
        with open(path) as f:
            for key, rows in json.load(f).items():
                r.setdefault(key, []).extend(rows)
    if not r["kiln"]:
        render_regression(r["regression"])
        return
    kiln = {(x["model"], x["batch"]): x for x in r["kiln"]}
    peer = {(x["model"], x["peer"], x["batch"]): x for x in r["peers"]}
    print("| model | Kiln b1 ms | PyTorch CUDA graph b1 ms | ratio | torch.compile b1 ms | ratio | Kiln b64 img/s | PyTorch CUDA graph b64 | ratio | torch.compile b64 | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in dict.fromkeys(x["model"] for x in r["kiln"]):
        k1, k64 = kiln.get((model, 1)), kiln.get((model, 64))
        g1, g64 = peer.get((model, "torch fp16 cuda-graph", 1)), peer.get((model, "torch fp16 cuda-graph", 64))
        c1, c64 = peer.get((model, "torch.compile reduce-overhead", 1)), peer.get((model, "torch.compile reduce-overhead", 64))
        ms = lambda x: f"{x['median_ms'] if 'median_ms' in x else x['ms']:.3f}" if x else "–"
        ips = lambda x: f"{x['img_s']:,.0f}" if x else "–"
        lat = lambda p: f"{p['ms'] / k1['median_ms']:.2f}×" if (p and k1) else "–"
        thr = lambda p: f"{k64['img_s'] / p['img_s']:.2f}×" if (p and k64) else "–"
        print(f"| {model} | {ms(k1)} | {ms(g1)} | {lat(g1)} | {ms(c1)} | {lat(c1)} | {ips(k64)} | {ips(g64)} | {thr(g64)} | {ips(c64)} | {thr(c64)} |")
    if r.get("regression"):
        print()
        render_regression(r["regression"])


def render_regression(rows):
    """One line per (model, batch): each build's best round median and new ÷ old speed (> 1: the
    new build is faster), then the counts."""
    best = {}
    for x in rows:
        key = (x["model"], x["batch"], x["build"])
        best[key] = min(best.get(key, float("inf")), x["median_ms"])
    print("| model | batch | old ms | new ms | speed new ÷ old |\n|---|---|---|---|---|")
    slower = []
    pairs = list(dict.fromkeys((m, b) for m, b, _ in best))
    for m, b in pairs:
        old, new = best.get((m, b, "old")), best.get((m, b, "new"))
        if old is None or new is None:
            print(f"| {m} | {b} | {old or '–'} | {new or '–'} | not measured |")
            continue
        ratio = old / new
        if ratio < 0.97:
            slower.append(f"{m} b{b} ({ratio:.2f}×)")
        print(f"| {m} | {b} | {old:.3f} | {new:.3f} | {ratio:.2f}× |")
    print(f"\n{len(pairs)} (model, batch) pairs; slower by more than 3 %: {', '.join(slower) or 'none'}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kiln", help="the kiln binary (device)")
    p.add_argument("--old", help="an older kiln binary for the regression check (device)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--models", default="", help="comma-separated subset of the zoo")
    p.add_argument("--compile", action="store_true", help="also torch.compile (reduce-overhead)")
    p.add_argument("--compile-batches", default="64,1")
    p.add_argument("--budget", type=float, default=480, help="seconds after which torch.compile steps are skipped")
    p.add_argument("--regress", default="flagships", help="with --old: 'flagships', 'all' or comma-separated bundled models")
    p.add_argument("--regress-only", action="store_true", help="with --old: only the regression check")
    p.add_argument("--rounds", type=int, default=2, help="regression rounds (the builds' order swaps each round)")
    p.add_argument("--duration", type=float, default=2.0, help="seconds `kiln bench` times each batch in the regression check")
    p.add_argument("--shard", default="0/1", help="I/N: the regression check's models I, I+N, I+2N, ...")
    p.add_argument("--render", nargs="+", help="zoo.json files from the device: print the markdown tables")
    args = p.parse_args()
    if args.render:
        render(args.render)
    elif args.kiln:
        device(args)
    else:
        sys.exit("give --kiln (on the device) or --render (here)")


if __name__ == "__main__":
    main()
