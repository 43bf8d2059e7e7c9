#!/usr/bin/env python3
"""A storm, a restart under load and a soak on a Triton server serving Kiln engines on a GPU
(tools/triton-gpu-storm.sh writes the repository and the references, then runs this).

The server runs KIND_GPU instances of three models at once (all FP32 engines, built by the backend
from graph files on first load):
  resnet18_dyn     two instances; an H x W profile 3x64x64..3x160x160, max_batch_size 2
  resnet18_finite  the same graph, refusing NaN and infinity
  mobilenet_v2     224 x 224, max_batch_size 4 (the soak's model)

Every valid answer is checked against `kiln compare --fp32` on the same input, on the same GPU (the
references, made before the server starts: `<model>__<tag>.safetensors` with `input.input` and
`output.logits`); FP32 engines built apart may choose other tactics, so the bound is rel L2 <= 1e-4.

Phases, each bounded in time (the whole run by --deadline-s):
  storm    --requests from --clients threads, about 30% malformed (the kinds in `malformed`), over
           HTTP (binary and JSON), gRPC and CUDA shared memory (inputs and outputs in device memory,
           registered through gRPC). Malformed requests must get an error answer; Kiln's refusals
           must be INVALID_ARG and must not count as `nv_inference_request_failure{reason="BACKEND"}`.
  restart  valid requests from --clients threads while the server is stopped (SIGTERM) and started
           again: every answer must be right, the only failures are refused connections while it is
           down, it must stop cleanly (exit 0, no crash in its log) and serve again.
  soak     --soak-s seconds of valid 224 x 224 requests (HTTP, gRPC, CUDA shared memory) on
           mobilenet_v2, sampling the server's RSS and its device memory every --sample-s seconds
           into soak.csv; the curve must level off (the last third's peak within 5% of the
           second third's).

HTTP is spoken directly (the v2 protocol and its binary extension, http.client); gRPC and CUDA shared
memory go through tritonclient.grpc; device memory comes from the CUDA runtime through ctypes.
Prints PASS/FAIL lines and `gpu storm: N passed, M failed`; writes summary.json and soak.csv to --out.
"""

import argparse
import base64
import collections
import ctypes
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from triton_checks import check, metric, raw_http, read_safetensors, rel_l2, report, run_storm, storm_plan

TIMEOUT_S = 60
DYN, FINITE, MNV2 = "resnet18_dyn", "resnet18_finite", "mobilenet_v2"
MODELS = (DYN, FINITE, MNV2)
TOL = 1e-4


class Cuda:
    """The few CUDA runtime calls CUDA shared memory needs, through ctypes."""

    def __init__(self):
        names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
        for site in sys.path:
            names += sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcudart.so*"), recursive=True))
        names += sorted(glob.glob("/usr/local/cuda*/targets/x86_64-linux/lib/libcudart.so*"))
        self.lib = None
        for n in names:
            try:
                self.lib = ctypes.CDLL(n)
                self.name = n
                break
            except OSError:
                continue
        if self.lib is None:
            raise RuntimeError(f"no CUDA runtime library among {names[:6]}...")
        self.call("cudaSetDevice", ctypes.c_int(0))

    def call(self, fn, *args):
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            raise RuntimeError(f"{fn} returned CUDA error {rc}")

    def malloc(self, n):
        p = ctypes.c_void_p()
        self.call("cudaMalloc", ctypes.byref(p), ctypes.c_size_t(n))
        return p

    def h2d(self, ptr, arr):
        b = np.ascontiguousarray(arr).tobytes()
        self.call("cudaMemcpy", ptr, ctypes.c_char_p(b), ctypes.c_size_t(len(b)), ctypes.c_int(1))

    def d2h(self, ptr, n):
        buf = ctypes.create_string_buffer(n)
        self.call("cudaMemcpy", buf, ptr, ctypes.c_size_t(n), ctypes.c_int(2))
        return buf.raw

    def ipc_handle(self, ptr):
        """The region's cudaIpcMemHandle_t (64 bytes), base64-encoded as Triton's clients send it."""
        h = ctypes.create_string_buffer(64)
        self.call("cudaIpcGetMemHandle", h, ptr)
        return base64.b64encode(h.raw)

    def free(self, ptr):
        self.lib.cudaFree(ptr)


class Server:
    """tritonserver on 127.0.0.1, started, stopped and started again by this tool."""

    def __init__(self, a):
        self.a, self.proc, self.log, self.starts = a, None, None, 0

    def start(self):
        self.starts += 1
        self.log = open(os.path.join(self.a.out, f"tritonserver.{self.starts}.log"), "w")
        cmd = [self.a.server, f"--model-repository={self.a.repo}", f"--backend-directory={self.a.backends}",
               "--model-control-mode=explicit", *[f"--load-model={m}" for m in MODELS],
               "--strict-readiness=false", "--exit-on-error=false",
               "--http-address=127.0.0.1", f"--http-port={self.a.http.split(':')[1]}",
               "--grpc-address=127.0.0.1", f"--grpc-port={self.a.grpc.split(':')[1]}",
               "--metrics-address=127.0.0.1", f"--metrics-port={self.a.metrics.split(':')[1]}"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        t = time.time()
        while time.time() - t < 300:
            if self.proc.poll() is not None:
                return None
            if self.ready():
                return time.time() - t
            time.sleep(0.25)
        return None

    def ready(self):
        try:
            for path in ["/v2/health/ready"] + [f"/v2/models/{m}/ready" for m in MODELS]:
                with urllib.request.urlopen(f"http://{self.a.http}{path}", timeout=5) as r:
                    if r.status != 200:
                        return False
            return True
        except Exception:
            return False

    def stop(self):
        """SIGTERM, then up to 60 s for a clean exit: (exit code, seconds)."""
        t = time.time()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.log.close()
        return rc, time.time() - t

    def rss_mib(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
        return int(m.group(1)) / 1024 if m else float("nan")

    def device_mib(self):
        """The server's device memory (nvidia-smi's per-process figure), and the GPU's in use."""
        q = lambda *args: subprocess.run(["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        own = sum(float(l.split(",")[1]) for l in q("--query-compute-apps=pid,used_memory").splitlines() if l.split(",")[0].strip() == str(self.proc.pid))
        used = float(q("--query-gpu=memory.used", "-i", "0").split()[0])
        return own, used

    def crashed_in_log(self):
        text = open(self.log.name, errors="replace").read()
        return [w for w in ("panic", "Segmentation fault", "core dumped", "Aborted", "double free") if w in text]


def http_infer(url, model, x, binary=True):
    """One inference over HTTP, binary extension or JSON: the logits, or raises RuntimeError."""
    path = f"/v2/models/{model}/infer"
    x = np.ascontiguousarray(x, np.float32)
    if binary:
        data = x.tobytes()
        header = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "parameters": {"binary_data_size": len(data)}}],
                             "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
        status, headers, body = raw_http(url, path, header + data, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(header))}, TIMEOUT_S)
    else:
        header = json.dumps({"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}], "outputs": [{"name": "logits"}]}).encode()
        status, headers, body = raw_http(url, path, header, {"Content-Type": "application/json"}, TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:300].decode(errors='replace')}")
    n = int({k.lower(): v for k, v in headers.items()}.get("inference-header-content-length", len(body)))
    reply = json.loads(body[:n])
    out = reply["outputs"][0]
    if binary:
        return np.frombuffer(body[n : n + out["parameters"]["binary_data_size"]], "<f4").reshape(out["shape"])
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


class Clients:
    """Per thread: a gRPC client and two CUDA shared-memory regions (input, output) registered once."""

    def __init__(self, a, cuda, max_input_bytes, max_output_bytes):
        self.a, self.cuda, self.local = a, cuda, threading.local()
        self.sizes = (max_input_bytes, max_output_bytes)
        self.regions, self.lock = [], threading.Lock()

    def grpc(self):
        if not hasattr(self.local, "grpc"):
            self.local.grpc = grpcclient.InferenceServerClient(self.a.grpc)
        return self.local.grpc

    def shm(self):
        """(input region name, input pointer, output region name, output pointer) of this thread."""
        if not hasattr(self.local, "shm"):
            tag = f"t{threading.get_ident()}"
            regions = []
            for kind, n in zip(("in", "out"), self.sizes):
                ptr = self.cuda.malloc(n)
                name = f"{kind}_{tag}"
                self.grpc().register_cuda_shared_memory(name, self.cuda.ipc_handle(ptr), 0, n)
                regions.append((name, ptr))
                with self.lock:
                    self.regions.append((name, ptr))
            self.local.shm = (*regions[0], *regions[1])
        return self.local.shm

    def forget(self):
        """Unregisters every region (where the server is up) and frees it: each thread registers
        again when it next needs one (a restarted server knows none)."""
        try:
            grpcclient.InferenceServerClient(self.a.grpc).unregister_cuda_shared_memory()
        except Exception:
            pass
        with self.lock:
            for _, ptr in self.regions:
                self.cuda.free(ptr)
            self.regions.clear()
        self.local = threading.local()

    def infer(self, model, x, how):
        if how in ("http", "json"):
            return http_infer(self.a.http, model, x, how == "http")
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        out = grpcclient.InferRequestedOutput("logits")
        if how == "grpc":
            inp.set_data_from_numpy(x)
            return self.grpc().infer(model, [inp], outputs=[out], client_timeout=TIMEOUT_S).as_numpy("logits")
        in_name, in_ptr, out_name, out_ptr = self.shm()
        self.cuda.h2d(in_ptr, x)
        inp.set_shared_memory(in_name, x.nbytes)
        n_out = x.shape[0] * 1000 * 4
        out.set_shared_memory(out_name, n_out)
        self.grpc().infer(model, [inp], outputs=[out], client_timeout=TIMEOUT_S)
        return np.frombuffer(self.cuda.d2h(out_ptr, n_out), "<f4").reshape(x.shape[0], 1000)


def malformed(a, clients, rng):
    """Each kind: (name, who refuses it, the call). A call returns (status, message) for an error
    answer, or raises AssertionError when it got a success it should not have."""
    x64 = rng.standard_normal((1, 3, 64, 64), dtype=np.float32)
    path = f"/v2/models/{DYN}/infer"
    flat = x64.flatten().tolist()

    def http_json(doc, model_path=path):
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()

        def call():
            status, _, reply = raw_http(a.http, model_path, body, {"Content-Type": "application/json"}, TIMEOUT_S)
            if status == 200:
                raise AssertionError("answered as a success")
            return (str(status), reply[:200].decode(errors="replace"))

        return call

    def via(fn):
        def call():
            try:
                fn()
            except InferenceServerException as e:
                return (str(e.status() or "error"), str(e)[:200])
            except RuntimeError as e:
                return (str(e).split(":")[0], str(e)[:200])
            raise AssertionError("answered as a success")

        return call

    def shm_too_small():
        in_name, in_ptr, out_name, _ = clients.shm()
        inp = grpcclient.InferInput("input", [1, 3, 160, 160], "FP32")
        inp.set_shared_memory(in_name, 1 * 3 * 160 * 160 * 4 * 64)  # more bytes than the region has
        return clients.grpc().infer(DYN, [inp], client_timeout=TIMEOUT_S)

    def shm_unknown():
        inp = grpcclient.InferInput("input", [1, 3, 64, 64], "FP32")
        inp.set_shared_memory("no_such_region", x64.nbytes)
        return clients.grpc().infer(DYN, [inp], client_timeout=TIMEOUT_S)

    nan = x64.copy()
    nan[0, 1, 7, 9] = np.nan
    inputs = lambda **kv: {"inputs": [{"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": flat, **kv}]}
    return [
        ("HTTP body that is not JSON", "triton", http_json(b"{not json")),
        ("HTTP JSON without inputs", "triton", http_json({"outputs": []})),
        ("HTTP JSON datatype FP64 for FP32", "triton", http_json(inputs(datatype="FP64"))),
        ("HTTP JSON data shorter than its shape", "triton", http_json(inputs(data=flat[:100]))),
        ("HTTP JSON unknown input name", "triton", http_json(inputs(name="image"))),
        ("HTTP JSON unknown model", "triton", http_json(inputs(), "/v2/models/no_such_model/infer")),
        ("batch 3 over max_batch_size 2", "triton", via(lambda: http_infer(a.http, DYN, rng.standard_normal((3, 3, 64, 64), dtype=np.float32)))),
        ("size 3x224x224 outside the profile", "kiln", via(lambda: http_infer(a.http, DYN, rng.standard_normal((1, 3, 224, 224), dtype=np.float32)))),
        ("size 3x32x32 under the profile (gRPC)", "kiln", via(lambda: clients.infer(DYN, rng.standard_normal((1, 3, 32, 32), dtype=np.float32), "grpc"))),
        ("a NaN pixel, refuse_non_finite (CUDA shared memory)", "kiln", via(lambda: clients.infer(FINITE, nan, "cudashm"))),
        ("CUDA shared memory: a byte size past the region", "triton", via(shm_too_small)),
        ("CUDA shared memory: an unregistered region", "triton", via(shm_unknown)),
    ]


def backend_failures(a):
    return sum(metric(a.metrics, "nv_inference_request_failure", m, 'reason="BACKEND"') for m in MODELS)


def run_valid(clients, pool, idx, how):
    model, x, ref = pool[idx]
    y = clients.infer(model, x, how)
    return rel_l2(y, ref), bool(np.array_equal(y, ref))


def storm(a, clients, pool, rng, summary):
    kinds = malformed(a, clients, rng)
    before = backend_failures(a)
    hows = ["http", "json", "grpc", "cudashm"]
    plan = storm_plan(rng, a.requests, kinds, lambda i: (int(rng.integers(len(pool))), hows[i % 4]))
    outcomes, took = run_storm(plan, lambda arg: (arg[1], *run_valid(clients, pool, *arg)), kinds, a.clients, a.storm_s, TIMEOUT_S)
    answers = [o[1] for o in outcomes if o[0] == "ok"]
    worst = max((r for _, r, _ in answers), default=float("inf"))
    exact = sum(e for _, _, e in answers)
    wrong = [o for o in outcomes if o[0] in ("wrong", "error")]
    skipped = sum(o[0] == "skipped" for o in outcomes)
    by_how = dict(collections.Counter(h for h, _, _ in answers))
    bad_answers = sum(r > TOL for _, r, _ in answers)
    check(f"storm: {len(answers)} valid answers match `kiln compare --fp32` (rel L2 <= {TOL:g})", answers and bad_answers == 0,
          f"worst rel L2 {worst:.1e}, {exact} bit-exact, by protocol {by_how}")
    check("storm: no request failed unexpectedly, hung or was dropped", not wrong, "; ".join(str(w[1])[:200] for w in wrong[:3]))
    check(f"storm: ran within {a.storm_s} s", skipped == 0, f"{len(plan)} requests from {a.clients} clients in {took:.1f} s, {len(plan) / took:.0f} requests/s")
    got = collections.defaultdict(collections.Counter)
    for o in outcomes:
        if o[0] == "bad":
            k, (status, _) = o[1]
            got[k][status] += 1
    print("      malformed kinds and their answers (status: count), who refuses them:", flush=True)
    for k, (name, who, _) in enumerate(kinds):
        print(f"        {name:<52} {who:<7} {dict(got[k])}", flush=True)
    for k, (name, who, _) in enumerate(kinds):
        statuses = set(got[k])
        if who == "kiln":
            ok = statuses and statuses <= {"400", "StatusCode.INVALID_ARGUMENT", "HTTP 400"}
            check(f"storm, malformed, {name}: refused by Kiln as an invalid argument", ok, str(dict(got[k])))
        else:
            ok = statuses and all(s not in ("OK", "200") for s in statuses)
            check(f"storm, malformed, {name}: refused", ok, str(dict(got[k])))
    after = backend_failures(a)
    check('storm: Kiln\'s refusals are not counted as nv_inference_request_failure{reason="BACKEND"}', after == before, f"{before:.0f} before, {after:.0f} after")
    summary["storm"] = {"requests": len(plan), "valid": len(answers), "wrong_answers": bad_answers, "worst_rel_l2": worst, "bit_exact": exact,
                        "by_protocol": by_how, "unexpected_failures": len(wrong), "seconds": took,
                        "malformed": {kinds[k][0]: dict(v) for k, v in got.items()}}


def connection_error(e):
    """A refused or dropped connection (the server is down, or a client reconnects)."""
    text = f"{type(e).__name__}: {e}"
    return isinstance(e, (ConnectionError, OSError)) or any(w in text for w in ("UNAVAILABLE", "Connection refused", "Socket closed", "RemoteDisconnected"))


class Load:
    """Valid requests from `n` threads until `stop()`: thread `i` sends the pool entry and protocol
    `choose(rng, i)` gives, and each answer is checked against its reference. After an error a
    thread waits 50 ms (a server that is down is not hammered)."""

    def __init__(self, clients, pool, n, seed, choose):
        self.answered = collections.Counter()  # by protocol
        self.worst = 0.0
        self.wrong = []  # (model, protocol, rel L2) over TOL
        self.errors = []  # (time, "connection refused" or "refused otherwise", protocol, what)
        self.lock, self.done = threading.Lock(), threading.Event()

        def worker(i):
            rng = np.random.default_rng(seed + i)
            while not self.done.is_set():
                idx, how = choose(rng, i)
                try:
                    r, _ = run_valid(clients, pool, idx, how)
                    with self.lock:
                        self.answered[how] += 1
                        self.worst = max(self.worst, r)
                        if r > TOL:
                            self.wrong.append((pool[idx][0], how, r))
                except Exception as e:
                    with self.lock:
                        kind = "connection refused" if connection_error(e) else "refused otherwise"
                        self.errors.append((time.time(), kind, how, f"{type(e).__name__}: {str(e)[:160]}"))
                    time.sleep(0.05)

        self.threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def count(self):
        with self.lock:
            return sum(self.answered.values())

    def stop(self):
        self.done.set()
        for t in self.threads:
            t.join(timeout=TIMEOUT_S)


def restart(a, server, clients, pool, summary):
    """Valid requests from --clients threads while the server stops and starts again."""
    load = Load(clients, pool, a.clients, 1000, lambda rng, i: (int(rng.integers(len(pool))), ["http", "grpc"][i % 2]))
    time.sleep(a.restart_s / 3)
    answered_before = load.count()
    stopped_at = time.time()
    rc, stop_s = server.stop()
    crashed = server.crashed_in_log()
    start_s = server.start()
    ready_at = time.time()
    time.sleep(a.restart_s * 2 / 3)
    load.stop()
    errors, wrong, worst = load.errors, load.wrong, load.worst
    tally = {"answered": load.count(), **collections.Counter(e[1] for e in errors)}
    after = tally["answered"] - answered_before
    # While it stops, Triton unloads the models (gRPC answers NOT_FOUND "unknown model") and then
    # refuses connections; clients reconnect within a few seconds of it being ready again (gRPC's
    # backoff). Any error outside that window is a failure.
    late = [e for e in errors if e[0] < stopped_at or e[0] > ready_at + 10]
    kinds_down = dict(collections.Counter(re.sub(r"'[^']*'", "'…'", e[3])[:90] for e in errors))
    check("restart: the server stopped under load cleanly (SIGTERM, exit 0, no crash in its log)", rc == 0 and not crashed, f"exit {rc} in {stop_s:.1f} s {crashed or ''}")
    check("restart: the server started again and every model is ready", start_s is not None, f"ready in {start_s:.1f} s" if start_s else "not ready within 300 s")
    check(f"restart: every answer matches `kiln compare --fp32` (rel L2 <= {TOL:g})", not wrong and after > 0,
          f"{tally}, worst rel L2 {worst:.1e}; {answered_before} answers before the stop, {after} after; " + "; ".join(map(str, wrong[:3])))
    check("restart: requests are refused only while the server stops and starts (and 10 s after)", not late,
          f"{len(errors)} refused, {len(late)} outside the window; " + "; ".join(str(e[1:]) for e in late[:3]))
    print(f"      what the clients got while it was down: {kinds_down}", flush=True)
    summary["restart"] = {**tally, "while_down": kinds_down, "worst_rel_l2": worst, "exit_code": rc, "stop_s": stop_s, "start_s": start_s, "answers_after": after}


def soak(a, server, clients, pool, summary):
    pool224 = [i for i, (m, _, _) in enumerate(pool) if m == MNV2]
    how = ["http", "grpc", "cudashm"]
    load = Load(clients, pool, a.soak_clients, 2000, lambda rng, i: (pool224[int(rng.integers(len(pool224)))], how[i % 3]))
    t0 = time.time()
    rows = []
    with open(os.path.join(a.out, "soak.csv"), "w") as f:
        f.write("seconds,requests,rss_mib,server_device_mib,gpu_used_mib\n")
        while time.time() - t0 < a.soak_s:
            time.sleep(a.sample_s)
            own, used = server.device_mib()
            row = (time.time() - t0, load.count(), server.rss_mib(), own, used)
            rows.append(row)
            f.write("%.1f,%d,%.1f,%.0f,%.0f\n" % row)
            f.flush()
    load.stop()
    took = time.time() - t0
    total = load.count()
    failures = load.wrong + [e[2:] for e in load.errors]
    check(f"soak: every answer matches `kiln compare --fp32` (rel L2 <= {TOL:g})", not failures and total > 0,
          f"{total} answers in {took:.0f} s ({total / took:.0f}/s), {dict(load.answered)}, {len(load.errors)} failed, worst rel L2 {load.worst:.1e}; "
          + "; ".join(map(str, failures[:3])))
    thirds = [rows[len(rows) * k // 3 : len(rows) * (k + 1) // 3] for k in range(3)]
    if all(thirds):
        peak = [max(r[2] for r in part) for part in thirds]
        # nvidia-smi names no process inside some containers: then the GPU's memory in use.
        col = 3 if any(r[3] > 0 for r in rows) else 4
        dev = [max(r[col] for r in part) for part in thirds]
        check("soak: the server's RSS levels off (the last third's peak within 5% of the second's)", peak[2] <= peak[1] * 1.05,
              f"RSS peaks by third {peak[0]:.0f} / {peak[1]:.0f} / {peak[2]:.0f} MiB")
        check("soak: the server's device memory levels off (the last third's peak within 5% of the second's)", dev[2] <= dev[1] * 1.05 + 1,
              f"{'server' if col == 3 else 'GPU'} device memory peaks by third {dev[0]:.0f} / {dev[1]:.0f} / {dev[2]:.0f} MiB")
    print("      soak curve (seconds, answers, RSS MiB, server device MiB, GPU used MiB):", flush=True)
    for r in rows[:: max(1, len(rows) // 12)] + rows[-1:]:
        print("        %7.1f %8d %8.1f %8.0f %8.0f" % r, flush=True)
    summary["soak"] = {"seconds": took, "answers": total, "by_protocol": dict(load.answered), "failed": len(load.errors), "worst_rel_l2": load.worst, "curve": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True, help="the tritonserver binary")
    p.add_argument("--repo", required=True)
    p.add_argument("--backends", required=True)
    p.add_argument("--refs", required=True, help="folder of <model>__<tag>.safetensors from `kiln compare --save-outputs`")
    p.add_argument("--out", required=True)
    p.add_argument("--http", required=True)
    p.add_argument("--grpc", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--storm-s", type=int, default=180)
    p.add_argument("--restart-s", type=int, default=45)
    p.add_argument("--soak-s", type=int, default=300)
    p.add_argument("--soak-clients", type=int, default=16)
    p.add_argument("--sample-s", type=float, default=5)
    a = p.parse_args()
    for host in (a.http, a.grpc, a.metrics):
        if not host.startswith("127.0.0.1:"):
            sys.exit(f"the storm runs on 127.0.0.1 only, not {host}")
    os.makedirs(a.out, exist_ok=True)
    pool = []
    for path in sorted(glob.glob(os.path.join(a.refs, "*__*.safetensors"))):
        t, _ = read_safetensors(path)
        pool.append((os.path.basename(path).split("__")[0], np.array(t["input.input"]), np.array(t["output.logits"])))
    check("references from `kiln compare --fp32` for every model", {m for m, _, _ in pool} == set(MODELS), f"{len(pool)} inputs")
    cuda = Cuda()
    print(f"      CUDA runtime for the client's shared memory: {cuda.name}", flush=True)
    clients = Clients(a, cuda, max(x.nbytes for _, x, _ in pool), max(r.nbytes for _, _, r in pool))
    server = Server(a)
    summary = {}
    start_s = server.start()
    if not check("the server started with KIND_GPU instances of three models", start_s is not None, f"ready in {start_s or 0:.1f} s"):
        print(open(server.log.name).read()[-3000:])
        return report("gpu storm")
    alone = [run_valid(clients, pool, i, how)[0] for i in range(len(pool)) for how in ("http", "grpc", "cudashm")]
    check(f"each reference input alone, over HTTP, gRPC and CUDA shared memory (rel L2 <= {TOL:g})", max(alone) <= TOL, f"worst rel L2 {max(alone):.1e}")
    rng = np.random.default_rng(39)
    try:
        storm(a, clients, pool, rng, summary)
        clients.forget()
        restart(a, server, clients, pool, summary)
        clients.forget()
        soak(a, server, clients, pool, summary)
    finally:
        rc, _ = server.stop()
        crashed = server.crashed_in_log()
        check("the server stopped cleanly at the end (exit 0, no crash in its log)", rc == 0 and not crashed, f"exit {rc} {crashed or ''}")
        with open(os.path.join(a.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
    return report("gpu storm")


if __name__ == "__main__":
    sys.exit(main())
