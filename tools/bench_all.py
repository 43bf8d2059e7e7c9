#!/usr/bin/env python3
"""docs/BENCHMARKS.md's tables from one device run: Kiln FP16 beside every PyTorch peer that
issues 7, 8 and 12 ask for, within one device command (about 9 minutes on one H100).

  here:    bash tools/gpu-build.sh                the kiln CLI (release, stripped) into .carry/kiln/
  device:  bash tools/bench-all.sh                carry [".carry", ".whl"], timeout_s 600
  here:    python3 tools/bench_all.py render <files_at>/results.json    rewrites the tables in docs/BENCHMARKS.md
                                                                        and README's performance summary
  here:    python3 tools/bench_all.py device --cpu-smoke --out /tmp/smoke    every path on the CPU, tiny

The plan (`plan`): the bundled flagships (ResNet-18/50 at batch 1 and 256, CenterNet-R50 at 512 at
1 and 32) against PyTorch eager FP32, eager FP16 channels_last, FP16 + CUDA graph, torch.compile
reduce-overhead and torch.compile max-autotune with TORCHINDUCTOR_FREEZING=1; every classifier of
the zoo at batch 1 and 64 against FP16 + CUDA graph and reduce-overhead; YOLOv8n and YOLO11n at 640,
batch 1 and 32, NMS included on both sides, against Ultralytics' model under a CUDA graph and
reduce-overhead. The PyTorch side runs in tools/bench_torch.py workers, one per unit.

torch.compile takes tens of seconds per model and batch, so the run has two phases:
  1. every worker starts at once; each builds its model, warms cuDNN up under a shared GPU lock and
     compiles its torch.compile cases (max-autotune workers start once the others are warm, at
     lower CPU priority); meanwhile `kiln trace` writes each model's graph file (CPU only).
     Nothing is timed. The phase ends when every worker waits, or at its deadline (the run's
     deadline less the estimated time of phase 2): workers still compiling are stopped and their
     compile cases reported as "not measured (time)".
  2. one unit at a time, with nothing else on the GPU: `kiln bench` on the unit's graph file (one
     engine per batch, CUDA graphs), then the unit's worker times its peers and exits. A unit that
     would not finish before the run's deadline is reported as "not measured (time)".
Every result goes to results.json as it is known; BENCHMARKS.md (the repository's, with its
tables regenerated between `<!-- bench:NAME -->` markers), results.json and the logs land in --out.
"""

import argparse
import concurrent.futures
import datetime
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
DOC = os.path.join(ROOT, "docs", "BENCHMARKS.md")
LIBS = "/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib"

FLAGSHIPS = {"resnet18": [1, 256], "resnet50": [1, 256], "centernet": [1, 32]}
ZOO_BATCHES = [1, 64]
TRANSFORMERS = ["swin_t", "vit_b_16"]
YOLO_BATCHES = [1, 32]
MAX_AUTOTUNE = "resnet18:1,resnet18:256,resnet50:1,resnet50:256,centernet:1,centernet:32"
# Kiln's 8-bit precisions beside its FP16 on the flagships (issue 9), each from a calibration cache
# that `kiln calibrate` records on the device's CPU over CALIB_IMAGES random images (speed only:
# accuracy is tests/gpu_quant.rs's).
LOW_PRECISIONS = ["int8", "fp8", "best"]
CALIB_IMAGES, CALIB_S = 4, 10.0
# Seconds of phase 2 per unit: `kiln bench` per process and per batch (build and timing), a worker
# per process (its exit included) and per case. Phase 1 leaves phase 2 RESERVE times their sum.
KILN_S, KILN_BATCH_S = 1.0, 1.5
# The most one `kiln bench` call may take: an 8-bit ResNet-50 or CenterNet engine at its large
# batch times cuDNN's fused 8-bit plans for a minute or more, Best two plans (engine::best).
KILN_TIMEOUT_S = 240
WORKER_S, CASE_S = 1.0, {"compile": 0.4, "nms": 2.0, "other": 0.6}
RESERVE = 1.25
# Caches that outlive a run (a second run on the same machine compiles less): torch.compile's,
# Kiln's kernels and its timing caches.
CACHE = "/tmp/kiln-bench-cache"
TIME = "not measured (time)"

PEER_LABELS = {
    "kiln-fp16": "Kiln FP16 (CUDA graphs)",
    "eager-fp32": "PyTorch eager FP32 (TF32 on)",
    "eager-fp16": "PyTorch eager FP16 channels_last",
    "graph-fp16": "PyTorch FP16 + CUDA graph",
    "compile-ro": "torch.compile reduce-overhead",
    "compile-ma": "torch.compile max-autotune + freezing",
    "graph-fp16-nms": "Ultralytics FP16 + CUDA graph + NMS",
    "compile-ro-nms": "torch.compile reduce-overhead + NMS",
}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the plan -----------------------------------------------------------------------------------


def unit(name, model, kind, size, cases, kiln_batches=(), kiln_extra=(), flagship=(), zoo=()):
    """One worker's work: `cases` as (peer, batch), in the order they are compiled and timed;
    `flagship` and `zoo`: the batches of the tables the model appears in."""
    return dict(name=name, model=model, kind=kind, size=size, cases=[list(c) for c in cases], kiln_batches=list(kiln_batches),
                kiln_extra=list(kiln_extra), flagship=list(flagship), zoo=list(zoo), weights_out=None)


def classifier_unit(model, size, flagship, zoo):
    batches = sorted(set(flagship) | set(zoo))
    cases = [("eager-fp32", b) for b in flagship] + [("eager-fp16", b) for b in flagship]
    cases += [("graph-fp16", b) for b in batches]
    # Compile the large batches first: zoo batch-1 compiles are the first to go when time is short.
    cases += [("compile-ro", b) for b in sorted(batches, reverse=True)]
    kind = "classifier" if zoo else "centernet"
    return unit(model, model, kind, size, cases, kiln_batches=batches, flagship=flagship, zoo=zoo)


def yolo_unit(model, size, work, batches):
    cases = [(p, b) for b in batches for p in ("graph-fp16-nms", "graph-fp16")]
    cases += [("compile-ro-nms", b) for b in sorted(batches, reverse=True)]
    weights = os.path.join(work, f"{model}.weights.safetensors")
    u = unit(model, model, "yolo", size, cases, kiln_batches=batches, kiln_extra=["--weights", weights])
    u["weights_out"] = weights
    return u


def plan(args, work):
    """The units in phase 2's order: flagships (each followed by its max-autotune cases), YOLO,
    transformers, then the rest of the zoo."""
    sys.path.insert(0, TOOLS)
    import export_reference as er

    er.load_models(args.kiln)
    os.environ.setdefault("KILN_BIN", os.path.abspath(args.kiln))  # for bench_torch.py's processes
    classifiers = [m for m in er.MODELS if er.family(m) == "classifier"]
    yolos = [m for m in er.MODELS if er.family(m) == "yolo"]
    if args.cpu_smoke:  # batch 1 stays, larger batches become 2, inputs 64 pixels (ViT's must be 224)
        b = lambda bs: sorted({1 if x == 1 else 2 for x in bs})  # noqa: E731
        size = lambda m: 224 if m == "vit_b_16" else 64  # noqa: E731
    else:
        b, size = list, er.default_size
    wanted = lambda m: not args.models or m in args.models.split(",")  # noqa: E731
    ma = [(m, int(batch)) for m, batch in (c.split(":") for c in args.max_autotune.split(",") if c)]
    units = []
    for model, fb in FLAGSHIPS.items():
        if not wanted(model):
            continue
        zoo = b(ZOO_BATCHES) if model in classifiers else []
        units.append(classifier_unit(model, size(model), b(fb), zoo))
        for mb in sorted({b([batch])[0] for m, batch in ma if m == model}):
            units.append(unit(f"{model}-max-autotune-b{mb}", model, "max-autotune", size(model), [("compile-ma", mb)]))
    units += [yolo_unit(m, size(m), work, b(YOLO_BATCHES)) for m in yolos if wanted(m)]
    rest = TRANSFORMERS + [m for m in classifiers if m not in TRANSFORMERS and m not in FLAGSHIPS]
    units += [classifier_unit(m, size(m), [], b(ZOO_BATCHES)) for m in rest if wanted(m)]
    if args.kiln_only:  # the flagships' Kiln rows (FP16 and the 8-bit precisions) alone
        units = [dict(u, cases=[], kiln_batches=u["flagship"]) for u in units if u["flagship"] and u["kind"] != "max-autotune"]
    return units


def estimate(u):
    """Seconds phase 2 needs for unit `u`."""
    kiln = KILN_S + KILN_BATCH_S * len(u["kiln_batches"]) if u["kiln_batches"] else 0.0
    if u["flagship"]:  # the 8-bit builds time more layers; calibration runs on the CPU first
        kiln += CALIB_S + len(LOW_PRECISIONS) * (KILN_S + 2 * KILN_BATCH_S * len(u["flagship"]))
    kind = lambda p: "compile" if p.startswith("compile") else ("nms" if p.endswith("-nms") else "other")  # noqa: E731
    return kiln + WORKER_S + sum(CASE_S[kind(p)] for p, _ in u["cases"])


# ---- running it ---------------------------------------------------------------------------------


def machine(args):
    """Date, GPU, driver and the commit the kiln binary was built from (tools/gpu-build.sh)."""
    v = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    try:
        q = "--query-gpu=name,driver_version,memory.total"
        o = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
        v["gpu"], v["driver"], v["gpu_memory"] = [p.strip() for p in o.splitlines()[0].split(",")]
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        v["gpu"] = "CPU (smoke test)" if args.cpu_smoke else "?"
    commit = os.path.join(os.path.dirname(args.kiln), "COMMIT")
    v["kiln_commit"] = open(commit).read().strip() if os.path.exists(commit) else "?"
    return v


class Run:
    """One device run: the units, their workers, every row measured, and the clock."""

    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget
        self.out = os.path.abspath(args.out)
        self.work = os.path.join("/tmp", f"kiln-bench-{os.getpid()}")
        os.makedirs(self.out, exist_ok=True)
        os.makedirs(os.path.join(self.work, "kiln"), exist_ok=True)
        os.makedirs(CACHE, exist_ok=True)
        self.units = plan(args, self.work)
        self.procs = {}  # unit name -> Popen
        self.stopped = set()  # units whose worker phase 1's deadline stopped
        self.rows = []
        self.phases = {}
        self.device = "cpu" if args.cpu_smoke else "cuda"
        self.machine = machine(args)
        # PyTorch must not see the system cuDNN that Kiln needs (it bundles a newer one).
        self.torch_env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        self.torch_env.update(PYTHONUNBUFFERED="1", YOLO_OFFLINE="1", TORCHINDUCTOR_COMPILE_THREADS="1",
                              TORCHINDUCTOR_CACHE_DIR=os.path.join(CACHE, "inductor"))
        self.kiln_env = dict(self.torch_env, LD_LIBRARY_PATH=LIBS, KILN_CACHE_DIR=os.path.join(CACHE, "kiln"))

    def left(self):
        return self.deadline - time.time()

    def stem(self, u):
        return os.path.join(self.work, u["name"])

    def save(self):
        result = dict(versions=self.versions(), phases=self.phases, units=self.units, rows=self.rows,
                      budget_s=self.args.budget, wall_s=round(time.time() - self.t0, 1), command=self.args.command)
        tmp = os.path.join(self.out, "results.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, os.path.join(self.out, "results.json"))
        return result

    def versions(self):
        """The machine's, with what the workers and `kiln bench` reported."""
        v = dict(self.machine)
        for p in glob.glob(os.path.join(self.work, "*.json")):
            v.update(json.load(open(p)).get("versions", {}))
        v.update({"kiln_cudnn": r["cudnn"] for r in self.rows if r["peer"] == "kiln-fp16" and r.get("cudnn")})
        return v

    # -- phase 1 --

    def start_worker(self, u, cases=None, deadline=None):
        spec = dict(u, cases=cases if cases is not None else u["cases"], deadline=deadline or self.phase1_deadline,
                    work=self.work, lock=os.path.join(self.work, "gpu.lock"), device=self.device,
                    target_s=0.05 if self.args.cpu_smoke else 0.3, iters=[3, 5] if self.args.cpu_smoke else [20, 200])
        # Ultralytics writes its settings file on import: one folder per worker, no race.
        env = dict(self.torch_env, YOLO_CONFIG_DIR=self.stem(u) + "-ultralytics")
        if u["kind"] == "max-autotune":
            # Autotuning compiles many candidate kernels: a few threads for the spare cores.
            env.update(TORCHINDUCTOR_FREEZING="1", TORCHINDUCTOR_COMPILE_THREADS="4")
        for suffix in (".warm", ".parked", ".json"):
            if os.path.exists(self.stem(u) + suffix):
                os.remove(self.stem(u) + suffix)
        logf = open(self.stem(u) + ".log", "a")
        cmd = [sys.executable, os.path.join(TOOLS, "bench_torch.py"), json.dumps(spec)]
        if u["kind"] == "max-autotune":
            cmd = ["nice", "-n", "10"] + cmd
        self.procs[u["name"]] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                                 text=True, start_new_session=True)

    def has(self, u, suffix):
        return os.path.exists(self.stem(u) + suffix)

    def alive(self, u):
        p = self.procs.get(u["name"])
        return p is not None and p.poll() is None

    def stop(self, u):
        p = self.procs.get(u["name"])
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def trace_graphs(self):
        """`kiln trace` of every classifier and CenterNet (CPU only): phase 2's `kiln bench` then
        loads a graph file instead of generating the seeded weights and tracing once per batch."""

        def trace(u):
            if time.time() > self.phase1_deadline:
                return
            path = os.path.join(self.work, f"{u['model']}.kiln.safetensors")
            cmd = [self.args.kiln, "trace", u["model"], "--size", str(u["size"]), "-o", path]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, env=self.kiln_env, timeout=max(self.phase1_deadline - time.time(), 1))
                if p.returncode != 0:
                    log(f"kiln trace {u['model']} failed (its bench will trace): {p.stdout[-300:]}{p.stderr[-300:]}")
            except subprocess.TimeoutExpired:
                log(f"kiln trace {u['model']}: phase 1 ended first (its bench will trace)")

        todo = [u for u in self.units if u["kiln_batches"] and not u["kiln_extra"]]
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
        futures = [pool.submit(trace, u) for u in todo]
        pool.shutdown(wait=False)
        return futures

    def phase1(self):
        need = sum(estimate(u) for u in self.units)
        self.phase1_deadline = self.deadline - RESERVE * need - 15
        log(f"plan: {len(self.units)} units, {sum(len(u['cases']) for u in self.units)} PyTorch cases; phase 2 estimated at "
            f"{need:.0f} s, so phase 1 ends within {self.phase1_deadline - time.time():.0f} s")
        t = time.time()
        traces = self.trace_graphs()
        ma = [u for u in self.units if u["kind"] == "max-autotune"]
        for u in self.units:
            if u["kind"] != "max-autotune" and u["cases"]:
                self.start_worker(u)
        while True:
            others = [u for u in self.units if u["kind"] != "max-autotune"]
            if ma and all(self.has(u, ".warm") or not self.alive(u) for u in others):
                log("every worker is warm: starting the max-autotune workers")
                for u in ma:
                    self.start_worker(u)
                ma = []
            waiting = [u for u in self.units if u["name"] in self.procs and self.alive(u) and not self.has(u, ".parked")]
            if not waiting and not ma:
                break
            if time.time() > self.phase1_deadline:
                log(f"phase 1 deadline: stopping {', '.join(u['name'] for u in waiting) or 'nothing'}"
                    + (f"; max-autotune never started: {', '.join(u['name'] for u in ma)}" if ma else ""))
                for u in waiting + ma:
                    self.stop(u)
                    self.stopped.add(u["name"])
                break
            time.sleep(0.5)
        concurrent.futures.wait(traces, timeout=max(self.phase1_deadline - time.time(), 1))
        self.phases["phase1_s"] = round(time.time() - t, 1)
        log(f"phase 1 done in {self.phases['phase1_s']:.0f} s")

    # -- phase 2 --

    def calibrate(self, u):
        """A calibration cache for unit `u`'s model (`kiln calibrate` on random images, CPU), or
        None with the reason logged."""
        import numpy as np
        from safetensors.numpy import save_file

        data = os.path.join(self.work, f"{u['model']}.calib.safetensors")
        cache = os.path.join(self.work, f"{u['model']}.calib.json")
        images = np.random.default_rng(0).standard_normal((CALIB_IMAGES, 3, u["size"], u["size"])).astype(np.float32)
        save_file({"input": images}, data)
        cmd = [self.args.kiln, "calibrate", u["model"], "--size", str(u["size"]), "--data", data, "--batch", str(CALIB_IMAGES), "-o", cache]
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.kiln_env, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"kiln calibrate {u['model']} failed: {e}")
            return None
        with open(os.path.join(self.work, f"kiln-{u['model']}.log"), "a") as f:
            f.write("$ " + " ".join(cmd) + "\n" + p.stdout + "\n")
        if p.returncode != 0 or not os.path.exists(cache):
            log(f"kiln calibrate {u['model']} failed: {(p.stdout.strip().splitlines() or ['?'])[-1]}")
            return None
        return cache

    def kiln_bench(self, u, precision="fp16", batches=None, calibration=None):
        """`kiln bench` of unit `u` at its batches (or `batches`) in `precision`: from its graph
        file, else by name."""
        graph = os.path.join(self.work, f"{u['model']}.kiln.safetensors")
        sources = ([graph] if os.path.exists(graph) else []) + [u["model"]]
        out_json = os.path.join(self.work, "kiln", f"{u['model']}-{precision}.json")
        if self.args.cpu_smoke:
            mode = ["--cpu", "--iterations", "2", "--duration", "0", "--warmup", "0"]
        else:
            cache = ["--calibration-cache", calibration] if calibration else []
            mode = [f"--{precision}", *cache, "--cuda-graphs-only", "--duration", str(self.args.kiln_duration), "--warmup", "100",
                    "--timing-cache", os.path.join(CACHE, f"{u['model']}.timing-cache")]
        batches = batches or u["kiln_batches"]
        for source in sources:
            size = ["--size", str(u["size"])] if source == u["model"] else []
            cmd = [self.args.kiln, "bench", source, *size, *u["kiln_extra"], *mode, "--batch", ",".join(map(str, batches)),
                   "--json", out_json]
            if os.path.exists(out_json):
                os.remove(out_json)
            try:
                p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.kiln_env,
                                   timeout=max(min(self.left() - 5, KILN_TIMEOUT_S), 1))
                output, ok = p.stdout, p.returncode == 0 and os.path.exists(out_json)
            except subprocess.TimeoutExpired:
                output, ok = "timed out", False
            except OSError as e:  # no kiln binary: every Kiln row fails, the peers still run
                output, ok = f"cannot run {self.args.kiln}: {e}", False
            with open(os.path.join(self.work, f"kiln-{u['model']}.log"), "a") as f:
                f.write("$ " + " ".join(cmd) + "\n" + output + "\n")
            if ok:
                return json.load(open(out_json)), ""
            log(f"kiln bench {source} failed: {output.strip().splitlines()[-1] if output.strip() else '?'}")
        return [], (output.strip().splitlines() or ["?"])[-1][:200]

    def kiln_rows(self, u):
        self.add_kiln_rows(u, "fp16", u["kiln_batches"], *self.kiln_bench(u))
        if not u["flagship"] or self.args.cpu_smoke or not self.args.low_precision:
            return
        calibration = self.calibrate(u)
        for p in LOW_PRECISIONS:
            if calibration:
                self.add_kiln_rows(u, p, u["flagship"], *self.kiln_bench(u, p, u["flagship"], calibration))
            else:
                self.add_kiln_rows(u, p, u["flagship"], [], "calibration failed")

    def add_kiln_rows(self, u, precision, batches, records, error):
        peer, seen = f"kiln-{precision}", set()
        for r in records:
            seen.add(r["batch"])
            self.rows.append(dict(model=u["model"], peer=peer, batch=r["batch"], status="ok", ms=r["median_ms"],
                                  img_s=r["batch"] / r["median_ms"] * 1e3, p99_ms=r["p99_ms"], runs=r["iterations"],
                                  build_s=r["build_seconds"], cudnn=r.get("cudnn_version")))
            log(f"kiln {u['model']} {precision} b={r['batch']}: {r['median_ms']:.3f} ms")
        for b in batches:
            if b not in seen:
                self.rows.append(dict(model=u["model"], peer=peer, batch=b, status=f"failed: {error}"))

    def worker_rows(self, u):
        """Release unit `u`'s worker and collect its rows. A worker stopped at phase 1's deadline
        is replaced by a fresh one without its compile cases (its other peers still count)."""
        cases = [tuple(c) for c in u["cases"]]
        if not cases:
            return
        if not (self.alive(u) and self.has(u, ".parked")):
            cases = self.replace_worker(u, cases)
        if self.alive(u) and self.has(u, ".parked"):
            p = self.procs[u["name"]]
            p.stdin.write("go\n")
            p.stdin.flush()
            try:
                p.wait(timeout=max(min(self.left() - 5, 30 + 10 * estimate(u)), 1))
            except subprocess.TimeoutExpired:
                log(f"{u['name']}: timing took too long, stopped")
                self.stop(u)
        got = [r for r in self.rows_of(u) if (r["peer"], r["batch"]) in set(cases)]
        settled = {(r["peer"], r["batch"]) for r in got}
        cause = TIME if self.left() <= 5 else "failed: no result (see logs.tar.gz)"
        self.rows += got + [dict(model=u["model"], peer=p, batch=b, status=cause) for p, b in cases if (p, b) not in settled]

    def replace_worker(self, u, cases):
        """Settle the cases of a worker that is not waiting for its go; returns those left to time."""
        stopped = u["name"] in self.stopped
        self.stop(u)
        written = {(r["peer"], r["batch"]): r for r in self.rows_of(u)}
        cause = TIME if stopped else "failed: worker ended early (see logs.tar.gz)"
        rest = [c for c in cases if c not in written and stopped and not c[0].startswith("compile")]
        self.rows += [written.get(c, dict(model=u["model"], peer=c[0], batch=c[1], status=cause)) for c in cases if c not in rest]
        if rest:
            self.start_worker(u, cases=[list(c) for c in rest], deadline=time.time())
            while self.alive(u) and not self.has(u, ".parked") and self.left() > 5:
                time.sleep(0.2)
        return rest

    def rows_of(self, u):
        path = self.stem(u) + ".json"
        return json.load(open(path))["rows"] if os.path.exists(path) else []

    def phase2(self):
        t = time.time()
        kiln_s = 0.0
        for u in self.units:
            need = estimate(u)
            if self.left() < need:
                log(f"{u['name']}: {self.left():.0f} s left, {need:.0f} s needed: not measured")
                self.stop(u)
                self.rows += [dict(model=u["model"], peer=p, batch=b, status=TIME) for p, b in u["cases"]]
                self.rows += [dict(model=u["model"], peer="kiln-fp16", batch=b, status=TIME) for b in u["kiln_batches"]]
                continue
            t_unit = time.time()
            if u["kiln_batches"]:
                self.kiln_rows(u)
                kiln_s += time.time() - t_unit
            self.worker_rows(u)
            log(f"{u['name']}: phase 2 took {time.time() - t_unit:.1f} s (estimated {need:.1f})")
            self.save()
        self.phases.update(phase2_s=round(time.time() - t, 1), kiln_s=round(kiln_s, 1))

    def finish(self):
        for u in self.units:
            self.stop(u)
        self.phases["total_s"] = round(time.time() - self.t0, 1)
        result = self.save()
        with tarfile.open(os.path.join(self.out, "logs.tar.gz"), "w:gz") as tar:
            for p in sorted(glob.glob(os.path.join(self.work, "*.log"))):
                tar.add(p, arcname=os.path.basename(p))
        doc = render(result, open(DOC).read())
        with open(os.path.join(self.out, "BENCHMARKS.md"), "w") as f:
            f.write(doc)
        for name in TABLES:
            print(f"\n## {name}\n{TABLES[name](result)}", flush=True)
        shutil.rmtree(self.work, ignore_errors=True)
        log(f"done in {self.phases['total_s']:.0f} s: {self.phases}; results.json, BENCHMARKS.md and logs.tar.gz in {self.out}")


def device(args):
    run = Run(args)
    try:
        run.phase1()
        run.phase2()
    finally:
        run.finish()


# ---- render -------------------------------------------------------------------------------------


def index(result):
    return {(r["model"], r["peer"], r["batch"]): r for r in result["rows"]}


def fmt_ms(ms):
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}"


def fmt_rate(img_s):
    return f"{img_s / 1000:.1f} k" if img_s >= 1000 else f"{img_s:.0f}"


def status_cell(r):
    if r is None:
        return "–"
    return "not measured (time)" if r["status"] == TIME else "failed"


def ratio(peer, kiln):
    """Peer time over Kiln time (above 1: Kiln is faster), or None."""
    if peer and kiln and peer["status"] == "ok" and kiln["status"] == "ok":
        return peer["ms"] / kiln["ms"]
    return None


def summary(counts, label):
    parts = [f"{PEER_LABELS[p]} on {ahead} of {n}" for p, (ahead, n) in counts.items() if n]
    return f"Kiln is ahead of {'; '.join(parts)} {label}." if parts else ""


def tally(counts, peer, x):
    ahead, n = counts.get(peer, (0, 0))
    counts[peer] = (ahead + (x is not None and x > 1), n + (x is not None))


def units_of(result, *kinds):
    return [u for u in result["units"] if u["kind"] in kinds]


def cell(r, show):
    return show(r) if r and r["status"] == "ok" else status_cell(r)


def flagships_table(result):
    """Every peer at the flagships' batches: time (ratio)."""
    if not units_of(result, "classifier", "centernet") or not any(u["flagship"] for u in result["units"]):
        return "Not in this run."
    ix, peers = index(result), ["eager-fp32", "eager-fp16", "graph-fp16", "compile-ro", "compile-ma"]
    lines = ["| model | batch | Kiln FP16 (CUDA graphs) | " + " | ".join(PEER_LABELS[p] for p in peers) + " |", "|---" * (3 + len(peers)) + "|"]
    counts = {}
    for u in units_of(result, "classifier", "centernet"):
        for b in u["flagship"]:
            k = ix.get((u["model"], "kiln-fp16", b))
            cells = [u["model"], str(b), cell(k, lambda r: f"{fmt_ms(r['ms'])} ms" + (f" ({fmt_rate(r['img_s'])}/s)" if b > 1 else ""))]
            for p in peers:
                r = ix.get((u["model"], p, b))
                x = ratio(r, k)
                tally(counts, p, x)
                cells.append(cell(r, lambda r: f"{fmt_ms(r['ms'])} ms" + (f" ({x:.2f}×)" if x else "")))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + summary(counts, "rows")


def low_precision_table(result):
    """Kiln's INT8, FP8 and Best engines beside its FP16 on the flagships: time (FP16 time over it)."""
    ix = index(result)
    units = [u for u in units_of(result, "classifier", "centernet") if u["flagship"]]
    if not any(ix.get((u["model"], f"kiln-{p}", b)) for u in units for b in u["flagship"] for p in LOW_PRECISIONS):
        return "Not in this run."
    lines = ["| model | batch | Kiln FP16 | " + " | ".join(f"Kiln {p.upper() if p != 'best' else 'Best'}" for p in LOW_PRECISIONS) + " |",
             "|---" * (3 + len(LOW_PRECISIONS)) + "|"]
    for u in units:
        for b in u["flagship"]:
            k = ix.get((u["model"], "kiln-fp16", b))
            show = lambda r: f"{fmt_ms(r['ms'])} ms" + (f" ({fmt_rate(r['img_s'])}/s)" if b > 1 else "")  # noqa: E731
            cells = [u["model"], str(b), cell(k, show)]
            for p in LOW_PRECISIONS:
                r = ix.get((u["model"], f"kiln-{p}", b))
                x = ratio(k, r)
                cells.append(cell(r, lambda r: show(r) + (f" ({x:.2f}×)" if x else "")))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def zoo_table(result, units):
    """Batch-1 latency and large-batch throughput, Kiln beside the CUDA-graph and reduce-overhead peers."""
    if not units:
        return "Not in this run."
    ix = index(result)
    small, large = units[0]["zoo"]
    lines = [f"| model | Kiln b{small} ms | PyTorch CUDA graph b{small} ms | ratio | torch.compile b{small} ms | ratio | Kiln b{large} img/s | "
             f"PyTorch CUDA graph b{large} img/s | ratio | torch.compile b{large} img/s | ratio |", "|---" * 11 + "|"]
    counts = {}
    for u in units:
        cells = [u["model"]]
        for b, show in ((small, lambda r: fmt_ms(r["ms"])), (large, lambda r: f"{r['img_s']:,.0f}")):
            k = ix.get((u["model"], "kiln-fp16", b))
            cells.append(cell(k, show))
            for p in ("graph-fp16", "compile-ro"):
                r = ix.get((u["model"], p, b))
                x = ratio(r, k)
                tally(counts, (p, b), x)
                cells += [cell(r, show), f"{x:.2f}×" if x else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    parts = [f"{PEER_LABELS[p]} at batch {b} on {a} of {n}" for (p, b), (a, n) in counts.items() if n]
    return "\n".join(lines) + "\n\n" + (f"Kiln is ahead of {'; '.join(parts)} models." if parts else "")


def yolo_table(result):
    """Per batch: Kiln with its NMS layer beside Ultralytics' model with NMS (and without, for scale)."""
    if not units_of(result, "yolo"):
        return "Not in this run."
    ix, peers = index(result), ["graph-fp16-nms", "compile-ro-nms", "graph-fp16"]
    labels = [PEER_LABELS[p] for p in peers[:2]] + ["Ultralytics FP16 + CUDA graph, no NMS"]
    lines = ["| model | batch | Kiln FP16 (NMS in the engine) | " + " | ".join(f"{lab} | ratio" for lab in labels) + " |", "|---" * (3 + 2 * len(peers)) + "|"]
    counts = {}
    for u in units_of(result, "yolo"):
        for b in u["kiln_batches"]:
            show = lambda r: f"{fmt_ms(r['ms'])} ms" + (f" ({r['img_s']:,.0f} img/s)" if b > 1 else "")  # noqa: E731
            k = ix.get((u["model"], "kiln-fp16", b))
            cells = [u["model"], str(b), cell(k, show)]
            for p in peers:
                r = ix.get((u["model"], p, b))
                x = ratio(r, k)
                if p != "graph-fp16":
                    tally(counts, p, x)
                cells += [cell(r, show), f"{x:.2f}×" if x else "–"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + summary(counts, "rows (NMS on both sides)")


def segmentation_table(result):
    """torchvision's segmentation models exported with kiln-torch (tools/torch-engine-check.sh):
    Kiln FP16 beside PyTorch FP16 + CUDA graph; `None` (the table stays) when the run has none."""
    units = units_of(result, "segmentation")
    if not units:
        return None
    ix, counts = index(result), {}
    lines = ["| model | batch | Kiln FP16 (CUDA graphs) | PyTorch FP16 + CUDA graph | ratio |", "|---|---|---|---|---|"]
    for u in units:
        for b in u["kiln_batches"]:
            show = lambda r: f"{fmt_ms(r['ms'])} ms" + (f" ({r['img_s']:,.0f} img/s)" if b > 1 else "")  # noqa: E731
            k, r = ix.get((u["model"], "kiln-fp16", b)), ix.get((u["model"], "graph-fp16", b))
            x = ratio(r, k)
            tally(counts, "graph-fp16", x)
            lines.append(f"| {u['model']} | {b} | {cell(k, show)} | {cell(r, show)} | {f'{x:.2f}×' if x else '–'} |")
    v, size = result.get("versions", {}), units[0]["size"]
    source = (f"{size}×{size} input. One run of `{result['command']}` on one {v.get('gpu', '?')} ({v.get('date', '?')}), Kiln "
              f"{v.get('kiln_commit', '?')}, PyTorch {v.get('torch', '?')}, torchvision {v.get('torchvision', '?')}.")
    return "\n".join(lines) + "\n\n" + summary(counts, "rows") + "\n" + source


def environment(result):
    v, ph = result["versions"], result.get("phases", {})
    kiln = f"Kiln {v.get('kiln_commit', '?')} (cuDNN {v.get('kiln_cudnn', '?')} as loaded by the engine)"
    torch = (f"PyTorch {v.get('torch', '?')} (CUDA {v.get('torch_cuda', '?')}, cuDNN {v.get('torch_cudnn', '?')}), "
             f"torchvision {v.get('torchvision', '?')}, Ultralytics {v.get('ultralytics', '?')}")
    timing = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {s:.0f} s" for k, s in ph.items())
    return (f"Measured {v.get('date', '?')} on one {v.get('gpu', '?')} ({v.get('gpu_memory', '?')}, driver {v.get('driver', '?')}): "
            f"{kiln}; {torch}. One run of `{result['command']}` ({timing}; budget {result['budget_s']:.0f} s).")


MODEL_NAMES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50", "centernet": "CenterNet-R50"}


def readme_summary(result):
    """README's performance summary: the flagships' Kiln FP16 figures beside the CUDA-graph and
    torch.compile peers, and how often Kiln is ahead in the zoo; `None` when the run has neither."""
    ix, parts = index(result), []
    gpu = result.get("versions", {}).get("gpu", "?")
    ok = lambda r: r is not None and r["status"] == "ok"  # noqa: E731
    for u in units_of(result, "classifier", "centernet"):
        if not u["flagship"]:
            continue
        name = MODEL_NAMES.get(u["model"], u["model"]) + (" at 512, decode included," if u["kind"] == "centernet" else "")
        small, large = min(u["flagship"]), max(u["flagship"])
        k1, kn = ix.get((u["model"], "kiln-fp16", small)), ix.get((u["model"], "kiln-fp16", large))
        text = []
        if ok(k1):
            peers = [f"{PEER_LABELS[p]} {fmt_ms(r['ms'])} ms" for p in ("graph-fp16", "compile-ro") if ok(r := ix.get((u["model"], p, small)))]
            text.append(f"{fmt_ms(k1['ms'])} ms at batch {small}" + (f" ({', '.join(peers)})" if peers else ""))
        if ok(kn) and large != small:
            peer = ix.get((u["model"], "graph-fp16", large))
            x = ratio(peer, kn)
            text.append(f"{fmt_rate(kn['img_s'])} images/s at batch {large}" + (f" ({x:.2f}× PyTorch FP16 + CUDA graph)" if x else ""))
        if text:
            parts.append(f"{name} {' and '.join(text)}")
    lines = []
    if parts:
        lines.append(f"- FP16 on one {gpu}, CUDA graphs on, beside PyTorch in the same run: " + "; ".join(parts) + ".")
    zoo = [u for u in units_of(result, "classifier") if u["model"] not in TRANSFORMERS and u.get("zoo")]
    if zoo:
        counts = {}
        for u in zoo:
            for b in u["zoo"]:
                x = ratio(ix.get((u["model"], "graph-fp16", b)), ix.get((u["model"], "kiln-fp16", b)))
                tally(counts, b, x)
        said = [f"at batch {b} on {a} of {n}" for b, (a, n) in counts.items() if n]
        if said:
            lines.append(f"- The zoo beside torchvision's models with CUDA graphs (PyTorch FP16 + CUDA graph): Kiln ahead {' and '.join(said)}.")
    if not lines:
        return None
    return "\n".join(lines + ["- Every table, with the command and the machine: [docs/BENCHMARKS.md](docs/BENCHMARKS.md)."])


README = os.path.join(ROOT, "README.md")


def render_readme(result, readme):
    """`readme` with its `<!-- bench:summary -->` section rewritten, or as it is when the run has
    nothing for it (a run of other tables keeps the summary of the last run that had them)."""
    text = readme_summary(result)
    pattern = re.compile(r"(<!-- bench:summary -->\n).*?(\n<!-- /bench:summary -->)", re.S)
    if not pattern.search(readme):
        sys.exit("README.md has no <!-- bench:summary --> ... <!-- /bench:summary --> markers")
    return readme if text is None else pattern.sub(lambda m: m.group(1) + text + m.group(2), readme)


TABLES = {
    "env": environment,
    "flagships": flagships_table,
    "low-precision": low_precision_table,
    "zoo": lambda r: zoo_table(r, [u for u in units_of(r, "classifier") if u["model"] not in TRANSFORMERS]),
    "transformers": lambda r: zoo_table(r, [u for u in units_of(r, "classifier") if u["model"] in TRANSFORMERS]),
    "yolo": yolo_table,
    "segmentation": segmentation_table,
}


def render(result, doc):
    """`doc` with the text between each `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` replaced
    by that table: every table, or those the run names in `tables` (tools/torch_engine_check.py's
    run has the segmentation table alone); a table that has nothing from the run stays as it is."""
    for name, table in TABLES.items():
        pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(\n<!-- /bench:{name} -->)", re.S)
        if not pattern.search(doc):
            sys.exit(f"docs/BENCHMARKS.md has no <!-- bench:{name} --> ... <!-- /bench:{name} --> markers")
        if name not in result.get("tables", TABLES) or (text := table(result)) is None:
            continue
        doc = pattern.sub(lambda m: m.group(1) + text + m.group(2), doc)
    return doc


def render_doc(args):
    result = json.load(open(args.results))
    doc = render(result, open(args.doc).read())
    with open(args.doc, "w") as f:
        f.write(doc)
    print(f"rewrote the tables of {args.doc} from {args.results} ({len(result['rows'])} rows)")
    if args.readme:
        readme = open(args.readme).read()
        new = render_readme(result, readme)
        with open(args.readme, "w") as f:
            f.write(new)
        print(f"rewrote the performance summary of {args.readme}" if new != readme else f"{args.readme}: no summary in this run, left as it is")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    d = sub.add_parser("device", help="measure everything; results in --out")
    d.add_argument("--kiln", default=os.path.join(ROOT, ".carry", "kiln", "kiln"), help="the kiln binary")
    d.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    d.add_argument("--budget", type=float, default=525, help="seconds for the whole run")
    d.add_argument("--models", default="", help="comma-separated subset of the models")
    d.add_argument("--max-autotune", default=MAX_AUTOTUNE, help="model:batch pairs for torch.compile max-autotune ('' for none)")
    d.add_argument("--kiln-duration", type=float, default=0.4, help="seconds `kiln bench` times each batch")
    d.add_argument("--cpu-smoke", action="store_true", help="run every path on the CPU at tiny sizes (no GPU needed)")
    d.add_argument("--no-low-precision", dest="low_precision", action="store_false",
                   help="skip Kiln's INT8/FP8/Best rows on the flagships")
    d.add_argument("--kiln-only", action="store_true",
                   help="only Kiln's rows of the flagships (FP16 and the 8-bit precisions: the low-precision table), no PyTorch peer")
    d.set_defaults(fn=device)
    r = sub.add_parser("render", help="rewrite docs/BENCHMARKS.md's tables from a results.json")
    r.add_argument("results")
    r.add_argument("--doc", default=DOC)
    r.add_argument("--readme", default=README, help="README whose <!-- bench:summary --> section is rewritten ('' for none)")
    r.set_defaults(fn=render_doc)
    args = p.parse_args()
    if args.step == "device":
        shown = ("budget", "models", "max_autotune", "kiln_duration", "cpu_smoke", "low_precision", "kiln_only")
        flags = [f" --{k.replace('_', '-')}" + ("" if v is True else f" {v!r}") for k, v in vars(args).items() if k in shown and v != d.get_default(k)]
        args.command = "bash tools/bench-all.sh" + "".join(flags)
    args.fn(args)


if __name__ == "__main__":
    main()
