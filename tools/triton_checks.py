"""What Kiln's Triton tools share: PASS/FAIL lines and their tally, rel L2, safetensors files of f32
tensors, and raw HTTP. Needs numpy only (no tritonclient), so that it runs wherever the server does."""

import concurrent.futures
import http.client
import json
import re
import socket
import struct
import sys
import time
import urllib.request

import numpy as np

RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append((name, bool(ok)))
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f": {detail}" if detail else ""), flush=True)
    return ok


def report(what):
    """Prints `<what>: N passed, M failed` over every check so far; the exit status (0: all passed)."""
    passed = sum(ok for _, ok in RESULTS)
    failed = len(RESULTS) - passed
    print(f"{what}: {passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def write_safetensors(path, tensors, metadata=None):
    """A safetensors file of f32 tensors (the format: u64 header length, JSON header, raw data)."""
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """The f32 tensors of a safetensors file, by name, and its metadata."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, t in header.items():
        if t["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name} is {t['dtype']}, not F32")
        start, end = t["data_offsets"]
        out[name] = np.frombuffer(data[8 + n + start : 8 + n + end], dtype="<f4").reshape(t["shape"])
    return out, meta


def raw_http(host, path, body, headers, timeout=60):
    """A POST with exactly these bytes and headers: (status, reply headers, reply bytes)."""
    h, p = host.rsplit(":", 1)
    conn = http.client.HTTPConnection(h, int(p), timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def metric(url, name, model, label=""):
    """The sum of Triton's Prometheus metric `name` over the series of `model` (and `label`)."""
    with urllib.request.urlopen(f"http://{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    found = re.findall(rf'^{name}{{([^}}]*)}} ([0-9.e+]+)$', text, re.M)
    return sum(float(v) for labels, v in found if f'model="{model}"' in labels and label in labels)


def storm_plan(rng, requests, kinds, valid):
    """A fixed, seeded sequence of `requests`, about 30% malformed: ("bad", kind index) or
    ("ok", valid(i)); every one of the `kinds` at least once."""
    plan = []
    for i in range(requests):
        if rng.random() < 0.3:
            plan.append(("bad", int(rng.integers(len(kinds)))))
        else:
            plan.append(("ok", valid(i)))
    for k in range(len(kinds)):
        plan[(k * 7) % len(plan)] = ("bad", k)
    return plan


def run_storm(plan, valid, kinds, clients, seconds, timeout):
    """Sends `plan` (`storm_plan`'s) from `clients` threads within `seconds`: `valid(arg)` for an
    ("ok", arg) item, the kind's call for a ("bad", k) one. Each outcome: ("ok", valid's result),
    ("bad", (k, the call's (status, message))), ("wrong", (item, why)) for an AssertionError,
    ("error", (item, what)) for any other exception, ("skipped", None) past the deadline; and the
    seconds it took."""
    deadline = time.time() + seconds

    def one(item):
        if time.time() > deadline:
            return ("skipped", None)
        what, arg = item
        try:
            if what == "ok":
                return ("ok", valid(arg))
            return ("bad", (arg, kinds[arg][2]()))
        except AssertionError as e:
            return ("wrong", (item, str(e)))
        except Exception as e:
            return ("error", (item, f"{type(e).__name__}: {e}"))

    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(max_workers=clients) as ex:
        outcomes = list(ex.map(one, plan, timeout=seconds + timeout))
    return outcomes, time.time() - t


def free_ports(n):
    """`n` TCP ports free on 127.0.0.1 now."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


if __name__ == "__main__":
    # `python3 tools/triton_checks.py --free-ports N`: the ports, on one line (for the shell scripts).
    if sys.argv[1:2] == ["--free-ports"]:
        print(*free_ports(int(sys.argv[2])))
