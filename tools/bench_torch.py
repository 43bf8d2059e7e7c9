#!/usr/bin/env python3
"""The PyTorch peers of tools/bench_all.py: one worker process per unit of its plan (a model with
its peers, or one torch.compile max-autotune case), started and paced by bench_all.py.

Phase 1 (every worker at once, nothing timed): build the model; under the GPU lock, run it eagerly
at each batch so that cuDNN's algorithm search (torch.backends.cudnn.benchmark) sees a GPU with no
other kernels on it, then write `<name>.warm`; compile the torch.compile cases (the driver's
deadline permitting), write `<name>.parked` and wait for a line on stdin.
Phase 2 (one worker at a time, nothing else on the GPU): time every case, writing `<name>.json`
after each, and exit.

Peers (a case is a peer and a batch):
  eager-fp32       the model in FP32 (cuDNN may use TF32, PyTorch's default)
  eager-fp16       FP16, channels_last
  graph-fp16       FP16, channels_last, captured in a CUDA graph
  compile-ro       torch.compile(mode="reduce-overhead"), FP16 channels_last
  compile-ma       torch.compile(mode="max-autotune"), FP16 channels_last (the driver sets
                   TORCHINDUCTOR_FREEZING=1 for its process)
YOLO (Ultralytics' fused DetectionModel in FP16, NCHW as Ultralytics runs it): graph-fp16-nms and
compile-ro-nms are the forward under a CUDA graph / torch.compile followed by Ultralytics'
non_max_suppression (eager: its shapes depend on the data); graph-fp16 is the network alone.
Time: median of CUDA-event-timed calls (enough for about `target_s` seconds, within `iters`) after 5
warm-up calls. With device "cpu" (bench_all.py --cpu-smoke) everything runs in FP32 on the CPU,
without CUDA graphs, to exercise this file without a GPU.

  python3 tools/bench_torch.py '<unit JSON>'     (bench_all.py writes the JSON; see its Unit)
"""

import copy
import fcntl
import json
import os
import sys
import time
import traceback

import torch
import torchvision
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_reference as er  # noqa: E402

COMPILE_MODES = {"compile-ro": "reduce-overhead", "compile-ma": "max-autotune"}


def is_compile(peer):
    return peer.startswith("compile-")


def graphed(fn, x):
    """`fn` captured into a CUDA graph on a static copy of `x`; the returned callable replays it
    (on the CPU, `fn` itself)."""
    if not x.is_cuda:
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g, static = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(g):
        out = fn(static)

    def run(inp):
        static.copy_(inp)
        g.replay()
        return out

    return run


def sync(x):
    if x.is_cuda:
        torch.cuda.synchronize()


def timed(fn, x, target_s, iters):
    """(median ms, runs) of `fn(x)`: 5 warm-up calls, then as many timed calls as fill about
    `target_s` seconds, within `iters` = (fewest, most)."""

    def once():
        if x.is_cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn(x)
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        t = time.perf_counter()
        fn(x)
        return (time.perf_counter() - t) * 1e3

    for _ in range(5):
        fn(x)
    sync(x)
    n = int(min(max(target_s * 1e3 / max(once(), 1e-3), iters[0]), iters[1]))
    ts = sorted(once() for _ in range(n))
    return ts[n // 2], n


class GpuLock:
    """An exclusive lock on a file shared by every worker: held while a worker runs kernels whose
    timing decides something (cuDNN's algorithm search), so that no other worker's kernels do."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        self.f = open(self.path, "a")
        fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def build(unit):
    """The unit's network in FP32 on the CPU, in eval mode: torchvision's classifier or Kiln's
    CenterNet twin with PyTorch's random init, or Ultralytics' YOLO with export_reference's
    calibrated random weights (saved for Kiln first, then fused as Ultralytics' predictor does)."""
    model = unit["model"]
    torch.manual_seed(0)
    if not er.MODELS:
        er.load_models()  # the kiln binary named by $KILN_BIN (bench_all.py sets it)
    if er.family(model) != "yolo":
        return er.build(model).eval()
    net = er.load_weights(model, er.build(model), "torchvision", 0).eval()
    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, unit["weights_out"])
    net = net.fuse(verbose=False) if "verbose" in net.fuse.__code__.co_varnames else net.fuse()
    return net.eval()


class Peers:
    """The unit's model in each form its peers need, and each peer as a callable on an input."""

    def __init__(self, unit):
        self.unit = unit
        if not er.MODELS:
            er.load_models()
        self.yolo = er.family(unit["model"]) == "yolo"
        self.dev = unit["device"]
        self.half = torch.float16 if self.dev == "cuda" else torch.float32
        self.layout = torch.contiguous_format if self.yolo else torch.channels_last
        net = build(unit)
        needs_fp32 = any(p == "eager-fp32" for p, _ in unit["cases"])
        self.fp32 = copy.deepcopy(net).to(self.dev) if needs_fp32 else None
        self.fast = net.to(self.dev, self.half).to(memory_format=self.layout)
        self.compiled = {}

    def input(self, peer, batch):
        size, fp32 = self.unit["size"], peer == "eager-fp32"
        shape = (batch, 3, size, size)
        x = torch.rand(shape, device=self.dev) if self.yolo else torch.randn(shape, device=self.dev)
        return x if fp32 else x.to(self.half).to(memory_format=self.layout)

    def net(self, y):
        """The prediction tensor of a YOLO's (prediction, features) output; anything else as is."""
        return y[0] if self.yolo else y

    def compiled_forward(self, mode):
        if mode not in self.compiled:
            # dynamic=False: one static graph per batch, as the CUDA-graph peers have.
            self.compiled[mode] = torch.compile(self.fast, mode=mode, dynamic=False)
        c = self.compiled[mode]

        def run(x):
            # Each call is a new step: CUDA-graph trees may reuse the last call's output memory.
            torch.compiler.cudagraph_mark_step_begin()
            return self.net(c(x))

        return run

    def forward(self, peer, x):
        """The callable that `peer` times on inputs shaped like `x`."""
        if peer == "eager-fp32":
            return lambda t: self.net(self.fp32(t))
        if peer == "eager-fp16":
            return lambda t: self.net(self.fast(t))
        base = peer.removesuffix("-nms")
        if base == "graph-fp16":
            fn = graphed(lambda t: self.net(self.fast(t)), x)
        else:
            fn = self.compiled_forward(COMPILE_MODES[base])
        return self.with_nms(fn) if peer.endswith("-nms") else fn

    @staticmethod
    def with_nms(fn):
        from ultralytics.utils.nms import non_max_suppression

        return lambda x: non_max_suppression(fn(x), conf_thres=0.25, iou_thres=0.7, max_det=300)


def versions(yolo):
    v = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "torchvision": torchvision.__version__}
    if torch.cuda.is_available():
        v.update(torch_cudnn=torch.backends.cudnn.version(), torch_gpu=torch.cuda.get_device_name(0))
    if yolo:
        import ultralytics

        v["ultralytics"] = ultralytics.__version__
    return v


class Worker:
    def __init__(self, unit):
        self.unit = unit
        self.stem = os.path.join(unit["work"], unit["name"])
        self.result = {"unit": unit["name"], "versions": {}, "rows": []}
        self.ready = {}  # (peer, batch) -> (callable, input, compile seconds)

    def row(self, peer, batch, status, **extra):
        r = dict(model=self.unit["model"], peer=peer, batch=batch, status=status, **extra)
        self.result["rows"].append(r)
        timing = f"{r['ms']:9.3f} ms {r['img_s']:10.0f} img/s" if status == "ok" else status
        print(f"{r['model']:18s} {peer:16s} b={batch:<4d} {timing}", flush=True)
        tmp = self.stem + ".json.tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1)
        os.replace(tmp, self.stem + ".json")

    def failed(self, peer, batch, e):
        traceback.print_exc()
        self.row(peer, batch, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")

    def warm_up(self, peers):
        """Eager runs at every batch and precision the cases use, under the GPU lock: cuDNN's
        algorithm search happens here, on a GPU no other worker is using."""
        with GpuLock(self.unit["lock"]):
            for peer, b in dict.fromkeys((("eager-fp32" if p == "eager-fp32" else "eager-fp16"), b) for p, b in self.unit["cases"]):
                x = peers.input(peer, b)
                peers.forward(peer, x)(x)
                sync(x)
            if self.unit["device"] == "cuda":
                torch.cuda.empty_cache()  # cuDNN's search workspaces, while others compile
        open(self.stem + ".warm", "w").close()

    def compile_all(self, peers):
        """Phase 1: compile each torch.compile case while the deadline allows; the first call
        compiles and runs eagerly, the next two (under the GPU lock) record the CUDA graphs."""
        for peer, b in self.unit["cases"]:
            if not is_compile(peer):
                continue
            if time.time() > self.unit["deadline"]:
                self.row(peer, b, "not measured (time)")
                continue
            t0 = time.time()
            try:
                x = peers.input(peer, b)
                fn = peers.forward(peer, x)
                fn(x)
                sync(x)
                with GpuLock(self.unit["lock"]):
                    fn(x)
                    fn(x)
                    sync(x)
                self.ready[(peer, b)] = (fn, x, time.time() - t0)
                print(f"{self.unit['name']}: compiled {peer} at batch {b} in {time.time() - t0:.0f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - one case's failure must not stop the others
                self.failed(peer, b, e)

    def time_all(self, peers):
        """Phase 2: every case not already settled, in the unit's order."""
        settled = {(r["peer"], r["batch"]) for r in self.result["rows"]}
        for peer, b in self.unit["cases"]:
            if (peer, b) in settled:
                continue
            try:
                if is_compile(peer):
                    fn, x, compile_s = self.ready[(peer, b)]
                    extra = {"compile_s": round(compile_s, 1)}
                else:
                    x = peers.input(peer, b)
                    fn, extra = peers.forward(peer, x), {}
                ms, n = timed(fn, x, self.unit["target_s"], self.unit["iters"])
                self.row(peer, b, "ok", ms=ms, img_s=b / ms * 1e3, runs=n, **extra)
            except Exception as e:  # noqa: BLE001
                self.failed(peer, b, e)

    def run(self):
        torch.backends.cudnn.benchmark = True
        with torch.inference_mode():
            try:
                peers = Peers(self.unit)
                self.result["versions"] = versions(peers.yolo)
                self.warm_up(peers)
            except Exception as e:  # noqa: BLE001 - no model, no case
                for peer, b in self.unit["cases"]:
                    self.failed(peer, b, e)
                open(self.stem + ".warm", "w").close()
                return
            self.compile_all(peers)
            if self.unit["device"] == "cuda":
                torch.cuda.empty_cache()
            open(self.stem + ".parked", "w").close()
            sys.stdin.readline()  # the driver's go: the GPU is ours
            self.time_all(peers)


if __name__ == "__main__":
    Worker(json.loads(sys.argv[1])).run()
