#!/usr/bin/env python3
"""A bounded storm on a running Triton server serving Kiln models on the CPU (tools/triton-test.sh).

Models (written by triton-test.sh):
  resnet18_dyn     ResNet-18 with an H x W profile 3x64x64..3x160x160, max_batch_size 2
  resnet18_finite  the same, with parameters["refuse_non_finite"] = "true"

A fixed number of requests (--requests, default 320) from --clients threads (default 16), on
127.0.0.1 only; about 30% are malformed, of the kinds in MALFORMED. Every valid request is one of a
fixed pool of inputs (three sizes inside the profile, batch 1 and 2, over HTTP binary, HTTP JSON and
gRPC) whose answer was taken once, alone, before the storm; each answer in the storm must match it
(rel L2 <= 1e-5; how many are bit-exact is printed). Every malformed request must get an error
response (never a hang, a dropped connection or a crash), and the backend's refusals must be
INVALID_ARG (HTTP 400). After the storm the server and both models must be ready, and Triton's
`nv_inference_request_failure{reason="BACKEND"}` must not have counted the backend's refusals of
client mistakes. Every call is bounded in time, and so is the whole storm (--seconds).

Prints PASS/FAIL lines like tools/triton_client_test.py, a table of what each malformed kind got,
and `storm: N passed, M failed`; exits non-zero on any failure.
"""

import argparse
import collections
import json
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException
# The PASS/FAIL lines and their tally, and rel L2, as the client test prints and computes them.
from triton_checks import check, metric, rel_l2, report, run_storm, storm_plan
from triton_checks import raw_http as raw_post

TIMEOUT_S = 60
DYN, FINITE = "resnet18_dyn", "resnet18_finite"


class Clients:
    """One HTTP and one gRPC client per thread (tritonclient's clients are not thread-safe)."""

    def __init__(self, http_url, grpc_url):
        self.http_url, self.grpc_url = http_url, grpc_url
        self.local = threading.local()

    def http(self):
        if not hasattr(self.local, "http"):
            self.local.http = httpclient.InferenceServerClient(self.http_url, connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
        return self.local.http

    def grpc(self):
        if not hasattr(self.local, "grpc"):
            self.local.grpc = grpcclient.InferenceServerClient(self.grpc_url)
        return self.local.grpc

    def stub(self):
        if not hasattr(self.local, "stub"):
            import grpc

            self.local.stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(self.grpc_url))
        return self.local.stub


def valid(clients, model, x, how):
    """One valid request: `how` is http (binary), json (HTTP JSON data) or grpc. Returns logits."""
    if how == "grpc":
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        out = grpcclient.InferRequestedOutput("logits")
        return clients.grpc().infer(model, [inp], outputs=[out], client_timeout=TIMEOUT_S).as_numpy("logits")
    binary = how == "http"
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("logits", binary_data=binary)
    return clients.http().infer(model, [inp], outputs=[out], timeout=TIMEOUT_S * 1_000_000).as_numpy("logits")


def raw_http(host, path, body, headers):
    """A POST with exactly these bytes and headers: (status, reply text)."""
    status, _, reply = raw_post(host, path, body, headers, TIMEOUT_S)
    return status, reply.decode(errors="replace")


def json_body(model_input):
    return json.dumps({"inputs": [model_input], "outputs": [{"name": "logits"}]}).encode()


def malformed_kinds(http_url, clients, rng):
    """Each kind: (name, who should refuse it, the call). A call returns (status, message) for an
    error answer, or raises AssertionError when it got a success it should not have."""
    x64 = rng.standard_normal((1, 3, 64, 64), dtype=np.float32)
    path = f"/v2/models/{DYN}/infer"
    jh = {"Content-Type": "application/json"}

    def http_json(body, model_path=path):
        return lambda: raw_http(http_url, model_path, body, jh)

    def binary(declared, data):
        header = json.dumps(
            {"inputs": [{"name": "input", "shape": declared, "datatype": "FP32", "parameters": {"binary_data_size": len(data)}}]}
        ).encode()
        body = header + data
        return lambda: raw_http(
            http_url, path, body, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}
        )

    def via_client(fn):
        def call():
            try:
                fn()
            except InferenceServerException as e:
                return (e.status() or "error", str(e))
            raise AssertionError("answered as a success")

        return call

    def grpc_two_contents():
        # One input, two raw_input_contents: Triton's gRPC front end accepts it (and ignores
        # the second buffer); recorded, not required to fail.
        req = service_pb2.ModelInferRequest(model_name=DYN)
        inp = req.inputs.add()
        inp.name, inp.datatype = "input", "FP32"
        inp.shape.extend([1, 3, 64, 64])
        req.raw_input_contents.extend([x64.tobytes(), x64.tobytes()])
        try:
            clients.stub().ModelInfer(req, timeout=TIMEOUT_S)
        except Exception as e:  # grpc.RpcError
            return (getattr(e, "code", lambda: "error")(), str(getattr(e, "details", lambda: e)()))
        return ("OK", "accepted (the second buffer ignored)")

    nan = x64.copy()
    nan[0, 1, 7, 9] = np.nan
    inf = x64.copy()
    inf[0, 2, 0, 0] = np.inf
    flat = x64.flatten().tolist()
    return [
        ("HTTP body that is not JSON", "triton", http_json(b"{not json")),
        ("HTTP JSON without inputs", "triton", http_json(b'{"outputs": []}')),
        ("HTTP JSON input without datatype", "triton", http_json(json_body({"name": "input", "shape": [1, 3, 64, 64], "data": flat}))),
        ("HTTP JSON datatype FP64 for FP32", "triton", http_json(json_body({"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP64", "data": flat}))),
        ("HTTP JSON data shorter than its shape", "triton", http_json(json_body({"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": flat[:100]}))),
        ("HTTP JSON shape with a negative dim", "triton", http_json(json_body({"name": "input", "shape": [1, 3, -64, 64], "datatype": "FP32", "data": flat}))),
        ("HTTP JSON data of strings", "triton", http_json(json_body({"name": "input", "shape": [1, 2], "datatype": "FP32", "data": ["a", "b"]}))),
        ("HTTP JSON unknown input name", "triton", http_json(json_body({"name": "image", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": flat}))),
        ("HTTP JSON unknown output", "triton", http_json(json.dumps({"inputs": [{"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": flat}], "outputs": [{"name": "boxes"}]}).encode())),
        ("HTTP JSON unknown model", "triton", http_json(json_body({"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": flat}), "/v2/models/no_such_model/infer")),
        ("binary data shorter than its shape", "triton", binary([1, 3, 64, 64], x64.tobytes()[:1000])),
        ("binary shape [1, 3, 100000, 100000] with 48 kB", "triton", binary([1, 3, 100000, 100000], x64.tobytes())),
        ("binary header length past the body", "triton", lambda: raw_http(http_url, path, b'{"inputs": []}', {"Inference-Header-Content-Length": "100000"})),
        ("batch 3 over max_batch_size 2", "triton", via_client(lambda: valid(clients, DYN, rng.standard_normal((3, 3, 64, 64), dtype=np.float32), "http"))),
        ("size 3x224x224 outside the profile", "kiln", via_client(lambda: valid(clients, DYN, rng.standard_normal((1, 3, 224, 224), dtype=np.float32), "http"))),
        ("size 3x32x32 under the profile (gRPC)", "kiln", via_client(lambda: valid(clients, DYN, rng.standard_normal((1, 3, 32, 32), dtype=np.float32), "grpc"))),
        ("a NaN pixel, refuse_non_finite", "kiln", via_client(lambda: valid(clients, FINITE, nan, "http"))),
        ("an infinite pixel, refuse_non_finite (gRPC)", "kiln", via_client(lambda: valid(clients, FINITE, inf, "grpc"))),
        ("gRPC one input with two raw_input_contents", "recorded", grpc_two_contents),
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--http", required=True)
    p.add_argument("--grpc", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=int, default=300, help="the whole storm's limit")
    a = p.parse_args()
    for host in (a.http, a.grpc, a.metrics):
        if not host.startswith("127.0.0.1:"):
            sys.exit(f"the storm runs on 127.0.0.1 only, not {host}")
    rng = np.random.default_rng(39)
    clients = Clients(a.http, a.grpc)

    # The valid pool and its answers, each taken alone before the storm.
    sizes = [(64, 64), (64, 96), (96, 64)]
    pool = [rng.standard_normal((b, 3, h, w), dtype=np.float32) for (h, w) in sizes for b in (1, 2)]
    t = time.time()
    refs = [valid(clients, DYN, x, "http") for x in pool]
    finite_ok = valid(clients, FINITE, pool[0], "grpc")
    check("the valid pool's answers, alone", all(r.shape == (x.shape[0], 1000) for r, x in zip(refs, pool)), f"{len(pool)} inputs, {time.time() - t:.1f} s")
    check("resnet18_finite answers a finite input as resnet18_dyn does", rel_l2(finite_ok, refs[0]) <= 1e-6)
    kinds = malformed_kinds(a.http, clients, rng)
    failures_before = metric(a.metrics, "nv_inference_request_failure", DYN, 'reason="BACKEND"') + metric(
        a.metrics, "nv_inference_request_failure", FINITE, 'reason="BACKEND"'
    )

    # The plan: a fixed, seeded sequence of requests, about 30% malformed.
    plan = storm_plan(rng, a.requests, kinds, lambda i: (int(rng.integers(len(pool))), ["http", "json", "grpc"][i % 3], [DYN, FINITE][i % 5 == 0]))

    def ok(arg):
        idx, how, model = arg
        return (idx, how, valid(clients, model, pool[idx], how))

    outcomes, took = run_storm(plan, ok, kinds, a.clients, a.seconds, TIMEOUT_S)

    # Valid answers.
    answers = [o[1] for o in outcomes if o[0] == "ok"]
    worst = max((rel_l2(y, refs[idx]) for idx, _, y in answers), default=0.0)
    exact = sum(np.array_equal(y, refs[idx]) for idx, _, y in answers)
    wrong = [o for o in outcomes if o[0] in ("wrong", "error")]
    skipped = sum(o[0] == "skipped" for o in outcomes)
    by_how = collections.Counter(how for _, how, _ in answers)
    check(
        f"{len(answers)} valid answers in the storm match their answer alone (rel L2 <= 1e-5)",
        worst <= 1e-5 and answers,
        f"worst rel L2 {worst:.1e}, {exact} bit-exact, by protocol {dict(by_how)}",
    )
    check("no request failed unexpectedly, hung or was dropped", not wrong, "; ".join(str(w[1])[:200] for w in wrong[:3]))
    check(f"the storm ran within {a.seconds} s", skipped == 0, f"{len(plan)} requests from {a.clients} clients in {took:.1f} s")

    # Malformed requests: what each kind got.
    got = collections.defaultdict(collections.Counter)
    for o in outcomes:
        if o[0] == "bad":
            k, (status, message) = o[1]
            got[k][str(status)] += 1
    print("      malformed request kinds and their answers (status: count), who refuses them:", flush=True)
    for k, (name, who, _) in enumerate(kinds):
        print(f"        {name:<48} {who:<9} {dict(got[k])}", flush=True)
    for k, (name, who, _) in enumerate(kinds):
        statuses = set(got[k])
        if who == "kiln":
            # The backend's refusals are INVALID_ARG: HTTP 400, gRPC INVALID_ARGUMENT.
            ok = statuses and statuses <= {"400", "StatusCode.INVALID_ARGUMENT"}
            check(f"malformed, {name}: refused by Kiln as an invalid argument", ok, str(dict(got[k])))
        elif who == "triton":
            ok = statuses and all(s not in ("OK", "200") for s in statuses)
            check(f"malformed, {name}: refused", ok, str(dict(got[k])))

    # The server after the storm.
    c = httpclient.InferenceServerClient(a.http, network_timeout=30)
    check("server live and both models ready after the storm", c.is_server_live() and all(c.is_model_ready(m) for m in (DYN, FINITE)))
    failures_after = metric(a.metrics, "nv_inference_request_failure", DYN, 'reason="BACKEND"') + metric(
        a.metrics, "nv_inference_request_failure", FINITE, 'reason="BACKEND"'
    )
    refused = sum(sum(got[k].values()) for k, (_, who, _) in enumerate(kinds) if who == "kiln")
    check(
        'Kiln\'s refusals are not counted as nv_inference_request_failure{reason="BACKEND"}',
        failures_after == failures_before,
        f"{refused} refused by Kiln; BACKEND failures {failures_before:.0f} before, {failures_after:.0f} after",
    )
    again = valid(clients, DYN, pool[0], "http")
    check("the first valid input still gives its answer", rel_l2(again, refs[0]) <= 1e-5)

    return report("storm")


if __name__ == "__main__":
    sys.exit(main())
