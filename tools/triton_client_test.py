#!/usr/bin/env python3
"""Checks a running Triton server that serves Kiln models through the Kiln backend (KIND_CPU).

Started by tools/triton-test.sh, which writes the repository and starts the server:
  resnet18      ResNet-18 graph file, fixed 3x224x224, max_batch_size 8, dynamic batching
  resnet18_dyn  the same graph with an optimization profile 3x64x64..3x160x160, max_batch_size 2
  broken        the same graph with config.pbtxt dims that disagree with it (loaded here, must fail)

Checks, each printed as PASS or FAIL, then one closing line `triton: N passed, M failed`:
  - HTTP and gRPC answers agree, and match Kiln's CPU executor on the same input
    (`kiln compare --cpu --reference`, rel L2 <= 1e-5; and `kiln run --cpu --input`'s top-5);
  - a request of batch 3 matches its three single requests;
  - 64 concurrent clients through the dynamic batcher: every answer matches its single request;
    the batch sizes Triton formed are read from its statistics;
  - an input size inside resnet18_dyn's profile runs and matches `kiln compare` at that size;
  - each bad request (wrong dtype, wrong shape, missing input, unknown input, batch over the max,
    size outside the profile) gets an error, and the server and both models stay ready;
  - the broken model fails to load with a message naming both dims, and the others stay ready;
  - Triton's metrics count the model's successes and executions, and no backend failure for the
    backend's refusals of client mistakes.
Every client call is bounded in time; the script never waits on the server forever.
"""

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException
# The PASS/FAIL lines and their tally, rel L2 and safetensors files, shared with the storms.
from triton_checks import check, rel_l2, report, write_safetensors  # noqa: F401 (the storm imports them from here too)

TIMEOUT_S = 120
def http_infer(url, model, x, dtype="FP32", name="input", client=None):
    c = client or httpclient.InferenceServerClient(url, connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
    inp = httpclient.InferInput(name, list(x.shape), dtype)
    inp.set_data_from_numpy(x, binary_data=True)
    out = httpclient.InferRequestedOutput("logits", binary_data=True)
    return c.infer(model, [inp], outputs=[out], timeout=TIMEOUT_S * 1_000_000).as_numpy("logits")


def grpc_infer(url, model, x):
    c = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(model, [inp], outputs=[grpcclient.InferRequestedOutput("logits")], client_timeout=TIMEOUT_S).as_numpy("logits")


def kiln(args, timeout=TIMEOUT_S):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def compare_with_kiln(kiln_bin, model, x, logits, path, what):
    """`kiln compare <model> --cpu --reference` with Triton's answer as the reference."""
    write_safetensors(path, {"input": x, "output.logits": logits})
    r = kiln([kiln_bin, "compare", model, "--cpu", "--reference", path, "--l2-tol", "1e-5"])
    m = re.search(r"rel_l2 (\S+) max_abs (\S+)", r.stdout)
    detail = f"kiln: rel L2 {m.group(1)}, max abs {m.group(2)}" if m else (r.stdout + r.stderr).strip()[-300:]
    ok = check(f"{what} match `kiln compare {os.path.basename(model)} --cpu` (rel L2 <= 1e-5)", r.returncode == 0 and m, detail)
    if not ok:
        print(r.stdout, r.stderr)
    return ok


def stats(url, model):
    c = httpclient.InferenceServerClient(url, network_timeout=TIMEOUT_S)
    s = c.get_inference_statistics(model)["model_stats"][0]
    batches = {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s.get("batch_stats", [])}
    return int(s.get("inference_count", 0)), int(s.get("execution_count", 0)), batches


def expect_error(name, fn, must_contain=()):
    try:
        fn()
    except InferenceServerException as e:
        msg = str(e)
        ok = all(s.lower() in msg.lower() for s in must_contain)
        return check(name, ok, msg.strip()[:300])
    except Exception as e:  # a transport error is a crash, not an answer
        return check(name, False, f"{type(e).__name__}: {e}")
    return check(name, False, "no error")


def still_up(url, models):
    c = httpclient.InferenceServerClient(url, network_timeout=30)
    return c.is_server_live() and c.is_server_ready() and all(c.is_model_ready(m) for m in models)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--http", required=True)
    p.add_argument("--grpc", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--kiln", required=True, help="the kiln binary")
    p.add_argument("--graph", required=True, help="the ResNet-18 graph file the repository serves")
    p.add_argument("--work", required=True)
    p.add_argument("--clients", type=int, default=64)
    a = p.parse_args()
    rng = np.random.default_rng(2026)
    served = ["resnet18", "resnet18_dyn"]

    # 1. One request over HTTP and gRPC, against Kiln's CPU executor.
    x = rng.standard_normal((1, 3, 224, 224), dtype=np.float32)
    t = time.time()
    y_http = http_infer(a.http, "resnet18", x)
    took = time.time() - t
    check("HTTP infer resnet18 returns logits [1, 1000]", y_http is not None and y_http.shape == (1, 1000), f"{took:.2f} s")
    y_grpc = grpc_infer(a.grpc, "resnet18", x)
    check("gRPC infer matches HTTP", y_grpc.shape == (1, 1000) and rel_l2(y_grpc, y_http) <= 1e-6, f"rel L2 {rel_l2(y_grpc, y_http):.2e}")
    compare_with_kiln(a.kiln, a.graph, x, y_http, os.path.join(a.work, "ref_http.safetensors"), "HTTP logits")
    compare_with_kiln(a.kiln, a.graph, x, y_grpc, os.path.join(a.work, "ref_grpc.safetensors"), "gRPC logits")
    write_safetensors(os.path.join(a.work, "x.safetensors"), {"input": x})
    r = kiln([a.kiln, "run", a.graph, "--cpu", "--input", os.path.join(a.work, "x.safetensors"), "--top", "5"])
    top_kiln = [int(c) for c in re.findall(r"class\s+(\d+)", r.stdout)][:5]
    top_triton = [int(i) for i in np.argsort(-y_http[0])[:5]]
    check("`kiln run --cpu --input` gives Triton's top-5 classes", r.returncode == 0 and top_kiln == top_triton, f"kiln {top_kiln}, triton {top_triton}")

    # 2. A batch of 3 in one request against its single requests.
    xb = rng.standard_normal((3, 3, 224, 224), dtype=np.float32)
    yb = http_infer(a.http, "resnet18", xb)
    singles = [http_infer(a.http, "resnet18", xb[i : i + 1]) for i in range(3)]
    worst = max(rel_l2(yb[i : i + 1], singles[i]) for i in range(3))
    check("a batch-3 request matches its 3 single requests", yb.shape == (3, 1000) and worst <= 1e-5, f"worst rel L2 {worst:.2e}")

    # 3. Concurrent clients through the dynamic batcher.
    n = a.clients
    xs = rng.standard_normal((n, 1, 3, 224, 224), dtype=np.float32)
    t = time.time()
    refs = [http_infer(a.http, "resnet18", xs[i]) for i in range(n)]
    single_s = time.time() - t
    before = stats(a.http, "resnet18")

    def client(i):
        if i % 2:
            return grpc_infer(a.grpc, "resnet18", xs[i])
        return http_infer(a.http, "resnet18", xs[i])

    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(client, i) for i in range(n)]
        answers = []
        for f in futures:
            try:
                answers.append(f.result(timeout=TIMEOUT_S))
            except Exception as e:
                answers.append(e)
    conc_s = time.time() - t
    after = stats(a.http, "resnet18")
    errors = [e for e in answers if isinstance(e, Exception)]
    worst = max((rel_l2(y, refs[i]) for i, y in enumerate(answers) if not isinstance(y, Exception)), default=float("inf"))
    check(
        f"{n} concurrent clients (HTTP and gRPC): every answer matches its single request",
        not errors and worst <= 1e-5,
        f"worst rel L2 {worst:.2e}, {len(errors)} errors{(' (' + str(errors[0]) + ')') if errors else ''}; "
        f"{conc_s:.1f} s concurrent vs {single_s:.1f} s one by one",
    )
    formed = {b: c - before[2].get(b, 0) for b, c in after[2].items() if c - before[2].get(b, 0) > 0}
    inferences, executions = after[0] - before[0], after[1] - before[1]
    print(f"      batch sizes Triton formed for the {n} requests (batch size: executions): {dict(sorted(formed.items()))}", flush=True)
    check(
        "the dynamic batcher merged requests (statistics: inferences > executions, a batch > 1)",
        inferences == n and executions < n and max(formed, default=1) > 1,
        f"{inferences} inferences in {executions} executions",
    )

    # 4. An optimization profile: a size inside runs (checked against Kiln), outside is refused.
    xd = rng.standard_normal((1, 3, 96, 128), dtype=np.float32)
    yd = http_infer(a.http, "resnet18_dyn", xd)
    check("resnet18_dyn runs a 96x128 input inside its profile", yd.shape == (1, 1000))
    compare_with_kiln(a.kiln, "resnet18", xd, yd, os.path.join(a.work, "ref_dyn.safetensors"), "resnet18_dyn's 96x128 logits")

    # 5. Bad requests: each an error in its response; the server and its models stay up.
    url = a.http
    bad = [
        ("wrong dtype (FP64)", lambda: http_infer(url, "resnet18", x.astype(np.float64), dtype="FP64"), ["FP64"]),
        ("wrong shape (3x200x200)", lambda: http_infer(url, "resnet18", rng.standard_normal((1, 3, 200, 200), dtype=np.float32)), ["shape"]),
        ("missing input", lambda: httpclient.InferenceServerClient(url).infer("resnet18", [], timeout=TIMEOUT_S * 1_000_000), ["input"]),
        ("unknown input name", lambda: http_infer(url, "resnet18", x, name="image"), ["image"]),
        ("batch 9 over max_batch_size 8", lambda: http_infer(url, "resnet18", rng.standard_normal((9, 3, 224, 224), dtype=np.float32)), ["batch"]),
        ("size 3x224x224 outside resnet18_dyn's profile", lambda: http_infer(url, "resnet18_dyn", x), ["outside", "3x64x64..3x160x160"]),
        ("batch 3 over resnet18_dyn's max_batch_size 2", lambda: http_infer(url, "resnet18_dyn", rng.standard_normal((3, 3, 64, 64), dtype=np.float32)), ["batch"]),
    ]
    for name, fn, words in bad:
        expect_error(f"bad request, {name}: Triton error", fn, words)
        check(f"  server and models ready after: {name}", still_up(url, served))

    # 6. A model whose config.pbtxt disagrees with its graph fails to load, naming both.
    def load_broken():
        httpclient.InferenceServerClient(url, network_timeout=TIMEOUT_S).load_model("broken")

    expect_error("loading `broken` (config dims 3x200x200, graph 3x224x224) fails naming both", load_broken, ["[3, 200, 200]", "[3, 224, 224]"])
    # (The server runs with --strict-readiness=false: with it on, one model that failed to load
    # makes the whole server "not ready" in Triton's sense, though it serves the others.)
    check("  server and the other models ready after the failed load", still_up(url, served))
    check("  `broken` is not ready", not httpclient.InferenceServerClient(url, network_timeout=30).is_model_ready("broken"))
    y_again = http_infer(url, "resnet18", x)
    check("resnet18 still answers as before", rel_l2(y_again, y_http) <= 1e-6)

    # 7. Metrics.
    with urllib.request.urlopen(f"http://{a.metrics}/metrics", timeout=30) as r:
        metrics = r.read().decode()

    def metric(name, model):
        """The metric summed over its label sets (failures carry a `reason` label)."""
        found = re.findall(rf'^{name}{{[^}}]*model="{model}"[^}}]*}} ([0-9.e+]+)$', metrics, re.M)
        return sum(float(v) for v in found) if found else None

    ok_count = metric("nv_inference_request_success", "resnet18")
    exec_count, inf_count = metric("nv_inference_exec_count", "resnet18"), metric("nv_inference_count", "resnet18")
    check(
        "metrics count resnet18's successes and batched executions",
        None not in (ok_count, exec_count, inf_count) and ok_count >= 2 * n + 6 and exec_count < inf_count,
        f"success {ok_count:.0f}, inferences {inf_count:.0f}, executions {exec_count:.0f}",
    )
    # Triton rejects most bad requests before the model; the profile check is the backend's own,
    # an invalid argument (HTTP 400) that the backend leaves out of the failure counter, as
    # Triton leaves out the mistakes it refuses itself (docs/SERVING.md).
    fail_dyn = metric("nv_inference_request_failure", "resnet18_dyn")
    check("metrics count no backend failure for resnet18_dyn's refused sizes (client mistakes)", (fail_dyn or 0) == 0, f"failure {fail_dyn}")

    return report("triton")


if __name__ == "__main__":
    sys.exit(main())
