#!/usr/bin/env python3
"""Helpers of tools/triton-bench.sh, standard library only (the GPU machine has no registry):

  outputs   send N deterministic requests to a model over HTTP/JSON (optionally concurrently) and
            save every answer, to compare one GPU with two;
  same      compare two saved answer files: identical, or the largest difference;
  batches   the batches Triton formed between two snapshots of its model statistics;
  summary   perf_analyzer's CSVs beside `kiln bench --json`, as a Markdown table;
  ratios    two GPUs' throughput against one GPU's, run by run.

JSON carries f32 values exactly (Triton prints the shortest decimal that reads back to the same
double, and every f32 is one), so `same` compares bits.
"""

import argparse
import concurrent.futures
import csv
import glob
import json
import math
import os
import random
import re
import sys
import urllib.request


def request_body(name, shape, dtype, seed, output):
    rng = random.Random(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == "UINT8":
        data = [rng.randrange(256) for _ in range(n)]
    else:
        data = [rng.uniform(-2.0, 2.0) for _ in range(n)]
    body = {"inputs": [{"name": name, "shape": shape, "datatype": dtype, "data": data}]}
    if output:
        body["outputs"] = [{"name": output}]
    return json.dumps(body).encode()


def infer(url, model, body, timeout):
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/infer", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    return {o["name"]: {"shape": o["shape"], "data": o["data"]} for o in out["outputs"]}


def cmd_outputs(a):
    shape = [int(d) for d in a.shape.split("x")]
    bodies = [request_body(a.input, shape, a.dtype, a.seed + i, a.output) for i in range(a.count)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.concurrency)) as pool:
        answers = list(pool.map(lambda b: infer(a.url, a.model, b, a.timeout), bodies))
    with open(a.out, "w") as f:
        json.dump({"model": a.model, "shape": shape, "dtype": a.dtype, "seed": a.seed, "answers": answers}, f)
    print(f"{a.model}: {len(answers)} answers written to {a.out}")


def cmd_same(a):
    with open(a.a) as f:
        x = json.load(f)["answers"]
    with open(a.b) as f:
        y = json.load(f)["answers"]
    if len(x) != len(y):
        print(f"DIFFERENT: {len(x)} vs {len(y)} answers")
        return 1
    identical, worst = 0, 0.0
    for i, (p, q) in enumerate(zip(x, y)):
        same = True
        for name in p:
            if p[name]["shape"] != q[name]["shape"]:
                print(f"answer {i}, {name}: shape {p[name]['shape']} vs {q[name]['shape']}")
                same = False
                continue
            diff = max((abs(u - v) for u, v in zip(p[name]["data"], q[name]["data"])), default=0.0)
            worst = max(worst, diff)
            same &= diff == 0.0
        identical += same
    verdict = "IDENTICAL" if identical == len(x) else "DIFFERENT"
    print(f"{verdict}: {identical} of {len(x)} answers bit-identical ({a.a} vs {a.b}); largest difference {worst:.3g}")
    return 0 if identical == len(x) else 1


def model_stats(path):
    """inference and execution counts, and per batch size (count, compute ns), of a stats snapshot."""
    try:
        with open(path) as f:
            stats = json.load(f)["model_stats"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    sizes = {}
    for b in stats.get("batch_stats", []):
        infer = b.get("compute_infer", {})
        sizes[int(b["batch_size"])] = (int(infer.get("count", 0)), int(infer.get("ns", 0)))
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0)), sizes


def cmd_batches(a):
    before, after = model_stats(a.before), model_stats(a.after)
    if not after:
        print("batches: no statistics")
        return 1
    before = before or (0, 0, {})
    inferences, executions = after[0] - before[0], after[1] - before[1]
    sizes = []
    for size, (count, ns) in after[2].items():
        c0, ns0 = before[2].get(size, (0, 0))
        if count > c0:
            sizes.append((size, count - c0, (ns - ns0) / (count - c0) / 1e6))
    # The sizes that carried the most images, with the server's compute time per batch there.
    top = sorted(sizes, key=lambda s: -s[0] * s[1])[:4]
    avg = inferences / executions if executions else 0.0
    record = {"inferences": inferences, "executions": executions, "avg_batch": avg, "top": top}
    with open(a.out, "w") as f:
        json.dump(record, f)
    shown = ", ".join(f"{n}x batch {size} ({ms:.2f} ms compute)" for size, n, ms in top)
    print(f"    batches formed: {executions} executions, {avg:.1f} images on average; most images in {shown}")
    return 0


def read_perf(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    r = rows[-1]
    us = lambda k: float(r.get(k, "nan")) / 1000.0  # noqa: E731
    name = os.path.basename(path).rsplit(".", 1)[0]
    batch = re.search(r"_b(\d+)", name)
    formed = None
    stats = path[: -len(".csv")] + ".batches.json"
    if os.path.exists(stats):
        with open(stats) as f:
            formed = json.load(f).get("avg_batch")
    return {
        "name": name,
        "request_batch": int(batch.group(1)) if batch else 1,
        "concurrency": int(float(r.get("Concurrency", "0"))),
        "throughput": float(r["Inferences/Second"]),
        "p50_ms": us("p50 latency"),
        "p99_ms": us("p99 latency"),
        "queue_ms": us("Server Queue"),
        "compute_ms": us("Server Compute Infer"),
        "formed": formed,
    }


def kiln_bench_records(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        records = json.load(f)
    return [r for r in records if r.get("mode") == "cuda-graph"] or records


def cmd_summary(a):
    records = kiln_bench_records(a.kiln_bench)
    best = max(records, key=lambda r: r["img_s"]) if records else None
    lines = [f"### {a.title}", ""]
    if best:
        lines.append(
            f"`kiln bench` on the same engine: best {best['img_s']:.0f} images/s at batch {best['batch']} "
            f"({best['median_ms']:.2f} ms median, {best['device']}); "
            + ", ".join(f"batch {r['batch']} {r['img_s']:.0f}" for r in sorted(records, key=lambda r: r["batch"]))
            + " images/s."
        )
        lines.append("")
    lines.append(
        "| run | request batch | concurrency | images in flight | images/s | p50 ms | p99 ms | server queue ms | "
        "server compute ms | batch formed (avg) | % of kiln bench best |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [r for r in (read_perf(p) for p in glob.glob(os.path.join(a.dir, a.pattern))) if r]
    for r in sorted(rows, key=lambda r: (r["name"].split("_", 2)[-1], r["concurrency"])):
        pct = f"{100 * r['throughput'] / best['img_s']:.0f}%" if best else "-"
        formed = f"{r['formed']:.1f}" if r["formed"] is not None else "-"
        lines.append(
            f"| {r['name']} | {r['request_batch']} | {r['concurrency']} | {r['request_batch'] * r['concurrency']} | "
            f"{r['throughput']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['queue_ms']:.2f} | {r['compute_ms']:.2f} | "
            f"{formed} | {pct} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.append:
        with open(a.append, "a") as f:
            f.write(text + "\n")
    return 0


def cmd_ratios(a):
    def tput(folder, name):
        path = os.path.join(folder, name + ".csv")
        r = read_perf(path) if os.path.exists(path) else None
        return r["throughput"] if r else float("nan")

    b = a.req_batch
    pairs = [
        ("gRPC payloads, batch-1 requests", "c128_b1_grpc", ["c128_b1_grpc", "c256_b1_grpc"], ""),
        ("inputs in CUDA shared memory, batch-1 requests", "c256_b1_cuda_shm", ["c256_b1_cuda_shm", "c512_b1_cuda_shm"], ""),
        (f"inputs in CUDA shared memory, batch-{b} requests", f"c064_b{b}_cuda_shm", [f"c064_b{b}_cuda_shm", f"c128_b{b}_cuda_shm"],
         " (target >= 1.8x)"),
    ]
    for what, base, runs, target in pairs:
        one = tput(a.one, base)
        for run in runs:
            two = tput(a.two, run)
            if math.isnan(one) or math.isnan(two):
                continue  # a run this invocation skipped (QUICK=1) or that found no stable measurement
            c = int(run[1:4])
            print(f"- {what}, two GPUs at concurrency {c}: {two:.0f} images/s = {two / one:.2f}x one GPU's {one:.0f} "
                  f"at {int(base[1:4])}{target}")
    print()
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("outputs")
    o.add_argument("--url", required=True)
    o.add_argument("--model", required=True)
    o.add_argument("--input", default="input")
    o.add_argument("--output", default=None, help="the one output to ask for (default: all)")
    o.add_argument("--shape", required=True, help="the request's shape with its batch, e.g. 1x3x224x224")
    o.add_argument("--dtype", default="FP32")
    o.add_argument("--count", type=int, default=16)
    o.add_argument("--seed", type=int, default=7)
    o.add_argument("--concurrency", type=int, default=1)
    o.add_argument("--timeout", type=float, default=120)
    o.add_argument("--out", required=True)
    s = sub.add_parser("same")
    s.add_argument("a")
    s.add_argument("b")
    t = sub.add_parser("batches")
    t.add_argument("before")
    t.add_argument("after")
    t.add_argument("--out", required=True)
    r = sub.add_parser("ratios")
    r.add_argument("--one", required=True)
    r.add_argument("--two", required=True)
    r.add_argument("--req-batch", type=int, default=16)
    m = sub.add_parser("summary")
    m.add_argument("--dir", required=True)
    m.add_argument("--pattern", default="*.csv")
    m.add_argument("--kiln-bench", default=None)
    m.add_argument("--title", default="Triton")
    m.add_argument("--append", default=None)
    a = p.parse_args()
    commands = {"outputs": cmd_outputs, "same": cmd_same, "batches": cmd_batches, "summary": cmd_summary, "ratios": cmd_ratios}
    return commands[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
