#!/usr/bin/env python3
"""Helpers of tools/triton-bench.sh, standard library only (the GPU machine has no registry):

  outputs   send N deterministic requests to a model over HTTP/JSON (optionally concurrently) and
            save every answer, to compare one GPU with two;
  same      compare two saved answer files: identical, or the largest difference;
  summary   perf_analyzer's CSVs beside `kiln bench --json`, as a Markdown table.

JSON carries f32 values exactly (Triton prints the shortest decimal that reads back to the same
double, and every f32 is one), so `same` compares bits.
"""

import argparse
import concurrent.futures
import csv
import glob
import json
import os
import random
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


def read_perf(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return None
    r = rows[-1]
    us = lambda k: float(r.get(k, "nan")) / 1000.0  # noqa: E731
    return {
        "concurrency": int(float(r.get("Concurrency", "0"))),
        "throughput": float(r["Inferences/Second"]),
        "p50_ms": us("p50 latency"),
        "p99_ms": us("p99 latency"),
        "queue_ms": us("Server Queue"),
        "compute_ms": us("Server Compute Infer"),
    }


def cmd_summary(a):
    best = None
    if a.kiln_bench and os.path.exists(a.kiln_bench):
        with open(a.kiln_bench) as f:
            records = json.load(f)
        graphs = [r for r in records if r.get("mode") == "cuda-graph"] or records
        best = max(graphs, key=lambda r: r["img_s"]) if graphs else None
    lines = [f"### {a.title}", ""]
    if best:
        lines.append(
            f"`kiln bench` on the same engine: best {best['img_s']:.0f} images/s at batch {best['batch']} "
            f"({best['median_ms']:.2f} ms median, {best['device']})."
        )
        lines.append("")
    lines.append("| run | concurrency | images/s | p50 ms | p99 ms | server queue ms | server compute ms | % of kiln bench best |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(a.dir, a.pattern))):
        r = read_perf(path)
        if not r:
            continue
        pct = f"{100 * r['throughput'] / best['img_s']:.0f}%" if best else "-"
        name = os.path.basename(path).rsplit(".", 1)[0]
        lines.append(
            f"| {name} | {r['concurrency']} | {r['throughput']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['queue_ms']:.2f} | {r['compute_ms']:.2f} | {pct} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if a.append:
        with open(a.append, "a") as f:
            f.write(text + "\n")
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
    m = sub.add_parser("summary")
    m.add_argument("--dir", required=True)
    m.add_argument("--pattern", default="*.csv")
    m.add_argument("--kiln-bench", default=None)
    m.add_argument("--title", default="Triton")
    m.add_argument("--append", default=None)
    a = p.parse_args()
    return {"outputs": cmd_outputs, "same": cmd_same, "summary": cmd_summary}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
