"""The import corpus (issue 42): vision models this project never named, each exported with kiln-torch
at batch 2 and checked against PyTorch from the same graph file at batch 2 and 3.

The corpus: every torchvision classification model (`torchvision.models.list_models`) but the few too
large for a CPU run, torchvision's segmentation models, the backbones of its detection models, and
timm models across families, and segmentation_models_pytorch's architectures (each with a ResNet
and a mobile encoder, `encoder_weights=None`). Random initialisation (`pretrained=False`, `weights=None`: nothing is
downloaded), BatchNorm statistics and affine parameters drawn (so that folding them is exercised),
weights PyTorch initialises to zeros (ViT heads) drawn too, fresh random inputs in [-1, 1].

For each model:
1. export it with kiln-torch at batch 2, with PyTorch's outputs as a reference (an unsupported op is
   the report's op names and first reason, not a crash);
2. write a second reference at batch 3 from PyTorch;
3. `kiln compare FILE --reference REF --cpu` at both batches (the same graph file): relative L2 and
   max-abs of every output; a model passes when every output is within 1e-5 at both batches.

On the device (`--gpu`; tools/import-corpus-gpu.sh runs one process per GPU), each model is
exported there at batch 2 (no graph file is uploaded) and, from that one graph file:
1. an FP32 engine (strict FP32, no TF32: `kiln compare --fp32`) against PyTorch's FP32 outputs,
   rel L2 <= 1e-4;
2. an FP16 engine (`kiln compare --fp16 --save-outputs`): its rel L2 against PyTorch FP32 at most
   1.2x PyTorch's own FP16 error (the model in FP16, channels_last, on the same input), and its
   argmax agreement with FP32 (images of a `[N, classes]` output, pixels of a segmentation model's)
   at least PyTorch FP16's;
3. `kiln bench` (FP16, CUDA graphs, `--bench-duration`) and PyTorch FP16 under a CUDA graph at batch
   1 and 16.
`--compile` is a separate run (torch.compile is slow: its own calls): torch.compile
(`--compile-mode`) timed at batch 1 and 16 for every transformer and every model where Kiln leads
PyTorch's CUDA graph by less than 1.2x, as the device rows carried in `--resume-from` say.
`--budget S` stops before a model that might not finish in the S seconds left (and cuts each
model's limit to them), so a device call never loses its rows; `--resume-from JSON` skips the
models that file already has device (or torch.compile) results for from the same kiln commit. A model that fails is its row's
reason, and the run goes on. `--dry-run` runs the device's steps on the CPU (the CPU executor for
both engines, PyTorch FP32, eager timings at batch 1 and 2) to test them without CUDA.

Results go to `--out`/results.json after every model (`--resume` skips the models already there),
and the table to docs/IMPORT_CORPUS.md, its summary (the `Corpus: N of M` line, failures by reason)
to docs/IMPORT.md's "The import corpus" (written by this script; `--render` rewrites them from the
JSON alone). One model at a time, each under `--timeout` seconds.

    python3 tools/import_corpus.py                      # the whole corpus (CPU)
    python3 tools/import_corpus.py --subset smoke       # 4 models, a minute or two
    python3 tools/import_corpus.py resnet18 timm/convnext_atto --out /tmp/corpus
    python3 tools/import_corpus.py --gpu --dry-run resnet18 --out /tmp/dry   # the device's steps, on the CPU
    python3 tools/import_corpus.py --render             # the table from the JSON alone

On the device, where each call gets a fresh machine: `bash tools/import-corpus-gpu.sh` (its header
says what to carry), then here `--merge` joins each shard's rows to the CPU ones: a CPU row replaces
a CPU row; a device row adds its results to the model's row.

    python3 tools/import_corpus.py --gpu --shard 1/4 --budget 510 --resume-from docs/import_corpus.json --out $OUT/c1
    python3 tools/import_corpus.py --merge docs/import_corpus.json c1/results.json c2/results.json ...
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "IMPORT_CORPUS.md"
RESULTS = ROOT / "docs" / "import_corpus.json"

CPU_TOL, FP32_TOL = 1e-5, 1e-4
# Where the device's system cuDNN and CUDA libraries are (tools/bench_all.py's LIBS).
DEVICE_LIBS = "/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib"
EXPORT_BATCH, OTHER_BATCH = 2, 3
DEFAULT_SIZE = 64  # H = W for every model that takes any size (a short CPU run)

# torchvision classifiers left out, and why (`list_models` gives 80; these would take most of the
# CPU time box alone: over 250 M parameters, a 1-3 GB graph file written and read twice each).
TORCHVISION_SKIPPED = {
    "vit_h_14": "632 M parameters",
    "regnet_y_128gf": "645 M parameters",
    "vit_l_16": "304 M parameters",
    "vit_l_32": "306 M parameters",
}

# Input sizes other than DEFAULT_SIZE, where a model needs them (or a smaller one is not valid).
TORCHVISION_SIZES = {
    "inception_v3": 96,  # its stem needs at least 75 pixels
    "maxvit_t": 224,  # its window and grid partitions need 7 | H/32
    "swin_v2_t": 128, "swin_v2_s": 128, "swin_v2_b": 128,
}
# Builder arguments beyond `weights=None`.
TORCHVISION_KWARGS = {
    "googlenet": {"aux_logits": False, "init_weights": True},
    "inception_v3": {"aux_logits": False, "init_weights": True},
    "vit_b_16": {"image_size": DEFAULT_SIZE},
    "vit_b_32": {"image_size": DEFAULT_SIZE},
}

SEGMENTATION_SIZE = 96

# timm: (name, input size or None for DEFAULT_SIZE, extra create_model arguments). Small variants
# across the families; models with a fixed resolution (relative position tables, window partitions
# of a given grid) at the size they are built for, the others at DEFAULT_SIZE or an `img_size`.
TIMM = [
    # plain ViTs and their relatives
    ("vit_tiny_patch16_224", 64, {"img_size": 64}),
    ("vit_small_patch16_224", 64, {"img_size": 64}),
    ("deit_tiny_patch16_224", 64, {"img_size": 64}),
    ("deit_tiny_distilled_patch16_224", 64, {"img_size": 64}),
    ("deit3_small_patch16_224", 64, {"img_size": 64}),
    ("beit_base_patch16_224", 64, {"img_size": 64}),
    ("eva02_tiny_patch14_224", 224, {}),
    ("vit_relpos_small_patch16_224", 64, {"img_size": 64}),
    ("flexivit_small", 96, {"img_size": 96}),
    ("cait_xxs24_224", 64, {"img_size": 64}),
    ("xcit_nano_12_p16_224", 64, {"img_size": 64}),
    ("convit_tiny", 224, {}),
    ("pit_ti_224", 224, {}),
    ("crossvit_tiny_240", 240, {}),
    ("levit_128s", 224, {}),
    ("tiny_vit_5m_224", 224, {}),
    ("efficientformer_l1", 224, {}),
    ("efficientformerv2_s0", 224, {}),
    ("visformer_tiny", 224, {}),
    ("hiera_tiny_224", 224, {}),
    ("vitamin_small_224", 224, {}),
    # windows and hierarchies
    ("swin_tiny_patch4_window7_224", 224, {}),
    ("swinv2_tiny_window8_256", 256, {}),
    ("maxvit_nano_rw_256", 256, {}),
    ("coatnet_nano_rw_224", 224, {}),
    ("twins_pcpvt_small", 224, {}),
    ("pvt_v2_b0", 224, {}),
    ("mvitv2_tiny", 224, {}),
    ("gcvit_xxtiny", 224, {}),
    ("nest_tiny", 224, {}),
    ("davit_tiny", 224, {}),
    ("focalnet_tiny_srf", 224, {}),
    ("coat_lite_tiny", 224, {}),
    ("efficientvit_b0", 224, {}),
    ("efficientvit_m0", 224, {}),
    ("mobilevit_xxs", 256, {}),
    ("mobilevitv2_050", 256, {}),
    ("edgenext_xx_small", 256, {}),
    # convnets
    ("convnext_atto", None, {}),
    ("convnextv2_atto", None, {}),
    ("inception_next_tiny", None, {}),
    ("poolformer_s12", None, {}),
    ("poolformerv2_s12", None, {}),
    ("fastvit_t8", None, {}),
    ("repvit_m1", None, {}),
    ("efficientnet_b0", None, {}),
    ("tf_efficientnet_b0", None, {}),
    ("efficientnetv2_rw_t", None, {}),
    ("tf_efficientnetv2_b0", None, {}),
    ("mixnet_s", None, {}),
    ("tinynet_a", None, {}),
    ("mobilenetv3_small_050", None, {}),
    ("mobilenetv4_conv_small", None, {}),
    ("lcnet_050", None, {}),
    ("ghostnet_100", None, {}),
    ("ghostnetv2_100", None, {}),
    ("rexnet_100", None, {}),
    ("fbnetc_100", None, {}),
    ("hardcorenas_a", None, {}),
    ("mobileone_s0", None, {}),
    ("repvgg_a0", None, {}),
    ("regnetx_002", None, {}),
    ("regnety_002", None, {}),
    ("regnetz_b16", None, {}),
    ("resnet10t", None, {}),
    ("resnet18d", None, {}),
    ("resnet26d", None, {}),
    ("resnext26ts", None, {}),
    ("seresnext26d_32x4d", None, {}),
    ("resnest14d", None, {}),
    ("res2net50_26w_4s", None, {}),
    ("skresnet18", None, {}),
    ("sequencer2d_s", 224, {}),
    ("resnetv2_50", None, {}),
    ("tresnet_m", None, {}),
    ("gernet_s", None, {}),
    ("ese_vovnet19b_dw", None, {}),
    ("selecsls42b", None, {}),
    ("dpn68", None, {}),
    ("dla34", None, {}),
    ("hrnet_w18_small", None, {}),
    ("cspresnet50", None, {}),
    ("cs3darknet_s", None, {}),
    ("legacy_xception", None, {}),
    ("inception_v3", 96, {}),
    ("dm_nfnet_f0", None, {}),
    ("eca_nfnet_l0", None, {}),
    ("hgnet_tiny", None, {}),
    ("botnet26t_256", 256, {}),
    ("halonet26t", 256, {}),
    ("lambda_resnet26t", 256, {}),
    ("starnet_s1", None, {}),
    ("rdnet_tiny", None, {}),
    ("mambaout_femto", None, {}),
]

# segmentation_models_pytorch: each architecture with a ResNet and a mobile encoder (`encoder_weights=None`:
# nothing is downloaded), a few with a second one; 128² (every architecture's output stride of 32
# divides it), 3 classes.
SMP_SIZE = 128
SMP_ARCHS = ["Unet", "UnetPlusPlus", "FPN", "PSPNet", "DeepLabV3", "DeepLabV3Plus", "Linknet", "MAnet", "PAN", "UPerNet", "Segformer"]
SMP = [(arch, enc) for arch in SMP_ARCHS for enc in ("resnet18", "mobilenet_v2")] + [
    ("Unet", "resnet34"),
    ("FPN", "resnet34"),
    ("Unet", "tu-mobilenetv3_large_100"),
    ("DeepLabV3Plus", "tu-mobilenetv3_large_100"),
    ("Segformer", "mit_b0"),
]

SUBSETS = {
    # One of each kind the corpus holds, about a minute on the CPU.
    "smoke": ["resnet18", "timm/convnext_atto", "timm/vit_tiny_patch16_224", "fcn_resnet50"],
}


@dataclass
class Entry:
    name: str  # the corpus name: torchvision's, `timm/<name>` or `smp/<architecture>.<encoder>`
    source: str  # torchvision, torchvision.segmentation, torchvision.detection, timm, smp
    size: int  # input H = W
    build: object = field(repr=False, default=None)  # () -> nn.Module
    family: str | None = None  # default: the model class's module


def torchvision_entries():
    import torchvision

    out = []
    for name in torchvision.models.list_models(module=torchvision.models):
        if name in TORCHVISION_SKIPPED:
            continue
        kwargs = {"weights": None, **TORCHVISION_KWARGS.get(name, {})}
        out.append(Entry(name, "torchvision", TORCHVISION_SIZES.get(name, DEFAULT_SIZE), _builder(torchvision.models.get_model, name, kwargs)))
    for name in torchvision.models.list_models(module=torchvision.models.segmentation):
        kwargs = {"weights": None, "weights_backbone": None}
        out.append(Entry(name, "torchvision.segmentation", SEGMENTATION_SIZE, _builder(torchvision.models.get_model, name, kwargs)))
    for name in ("fasterrcnn_mobilenet_v3_large_fpn", "retinanet_resnet50_fpn", "fcos_resnet50_fpn", "ssdlite320_mobilenet_v3_large",
                 "maskrcnn_resnet50_fpn_v2"):
        kwargs = {"weights": None, "weights_backbone": None}
        size = 128
        out.append(Entry(f"{name}.backbone", "torchvision.detection", size, _backbone(name, kwargs)))
    return out


def _builder(fn, name, kwargs):
    return lambda: fn(name, **kwargs)


def _backbone(name, kwargs):
    """A detection model's backbone (with its FPN): the part that runs on a batch of images as a
    tensor (the rest is anchors, NMS and per-image lists, which `torch.export` cannot capture)."""
    def build():
        import torchvision

        return torchvision.models.get_model(name, **kwargs).backbone

    return build


def timm_entries():
    import timm

    out = []
    for name, size, kwargs in TIMM:
        out.append(Entry(f"timm/{name}", "timm", size or DEFAULT_SIZE, _timm_builder(timm, name, kwargs)))
    return out


def _timm_builder(timm, name, kwargs):
    return lambda: timm.create_model(name, pretrained=False, **kwargs)


def smp_entries():
    out = []
    for arch, enc in SMP:
        out.append(Entry(f"smp/{arch}.{enc}", "smp", SMP_SIZE, _smp_builder(arch, enc), family=arch.lower()))
    return out


def _smp_builder(arch, enc):
    def build():
        import segmentation_models_pytorch as smp

        return getattr(smp, arch)(encoder_name=enc, encoder_weights=None, classes=3)

    return build


def corpus() -> list:
    return torchvision_entries() + timm_entries() + smp_entries()


# ---- one model

def randomise(model, seed: int = 1) -> None:
    """BatchNorm statistics and affine parameters drawn (so that the folded scale and shift are
    not 1 and 0), and every weight PyTorch initialises to zeros (torchvision's ViT head, timm's
    zero-initialised last BN of a residual branch is covered above) drawn small, so that no output
    is a constant."""
    import torch
    import torch.nn as nn

    gen = torch.Generator().manual_seed(seed)

    def draw(t, lo, hi):
        t.copy_(torch.rand(t.shape, generator=gen) * (hi - lo) + lo)

    with torch.no_grad():
        for mod in model.modules():
            stats = getattr(mod, "running_mean", None) is not None and getattr(mod, "running_var", None) is not None
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) or (stats and type(mod).__name__ == "FrozenBatchNorm2d"):
                if getattr(mod, "running_mean", None) is None:
                    continue
                draw(mod.running_mean, -0.1, 0.1)
                draw(mod.running_var, 0.75, 1.25)
                if getattr(mod, "weight", None) is not None:
                    draw(mod.weight, 0.4, 1.0)
                if getattr(mod, "bias", None) is not None:
                    draw(mod.bias, -0.1, 0.1)
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not torch.any(p):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


class Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise Timeout()


# The `kiln` subprocesses' environment: on the device, the system cuDNN (`--kiln-libs`), which
# PyTorch, in this process, must not see (it bundles its own).
KILN_ENV = None


class GpuTurns:
    """Several workers on one GPU (`--turns DIR`, one folder per GPU): the checks share it (or,
    with `checks_alone`, have it alone too), a timing has it alone, so that no timing (`kiln bench`'s tactic choices and runs, PyTorch's replays) sees
    another process's kernels. A fair readers-writer lock over two files with flock: a timing takes
    the gate before it waits for the GPU, so no new check starts while it waits. Without a folder,
    both are no-ops. `waited` adds up the seconds spent waiting for a turn."""

    def __init__(self, folder=None, checks_alone=False):
        self.files = None
        self.checks_alone = checks_alone
        self.waited = 0.0
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.files = tuple(open(Path(folder) / name, "a+") for name in ("gate", "gpu"))

    @contextlib.contextmanager
    def _turn(self, mode):
        if self.files is None:
            yield
            return
        gate, gpu = self.files
        t = time.time()
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(gpu, mode)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        self.waited += time.time() - t
        try:
            yield
        finally:
            fcntl.flock(gpu, fcntl.LOCK_UN)

    def shared(self):
        return self._turn(fcntl.LOCK_EX if self.checks_alone else fcntl.LOCK_SH)

    def close(self):
        for f in self.files or ():
            f.close()
        self.files = None

    def alone(self):
        return self._turn(fcntl.LOCK_EX)


TURNS = GpuTurns()


def claim_file(folder, name: str) -> Path:
    """The file in `--claims DIR` that says a worker took `name`."""
    return Path(folder) / name.replace("/", "_")


def claim(folder, name: str) -> bool:
    """Whether this worker takes `name` (`--claims DIR`: the first worker to create its file; the
    workers of a call share the folder, so each model runs once and the fast ones take more)."""
    if not folder:
        return True
    Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(claim_file(folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def kiln_compare(kiln: str, path: Path, ref: Path, flags: list, tol: float, report: Path, timeout: float, save=None) -> dict:
    """`kiln compare` of `path` against `ref`: {ok, outputs: {name: (rel_l2, max_abs)}, error}."""
    cmd = [kiln, "compare", str(path), "--reference", str(ref), *flags, "--l2-tol", str(tol), "--report", str(report)]
    if save is not None:
        cmd += ["--save-outputs", str(save)]
    report.unlink(missing_ok=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1), env=KILN_ENV)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"kiln compare {' '.join(flags)} ran past the timeout"}
    if not report.exists():
        lines = [l for l in (p.stderr + p.stdout).strip().splitlines() if l.strip()]
        err = next((l for l in lines if l.startswith("error")), lines[-1] if lines else f"exit {p.returncode}")
        return {"ok": False, "error": f"kiln compare: {err.strip()}"}
    r = json.loads(report.read_text())
    outs = {o["name"]: [o["rel_l2"], o["max_abs"]] for o in r["outputs"]}
    return {"ok": bool(r["pass"]), "outputs": outs, "error": None if r["pass"] else f"rel L2 above {tol:.0e}"}


LAYOUT_COPIES = re.compile(r"^(\d+) layout copies planned", re.M)


def layout_copies(kiln: str, path: Path, timeout: float):
    """The layout copies an engine of the graph file would make (`kiln inspect --no-engine`: the
    values read in another layout than they are stored in, from the builder's own layout rules;
    no GPU needed), or None when inspect fails."""
    try:
        p = subprocess.run([kiln, "inspect", "--no-engine", str(path)], capture_output=True, text=True, timeout=max(timeout, 1), env=KILN_ENV)
    except subprocess.TimeoutExpired:
        return None
    m = LAYOUT_COPIES.search(p.stdout) if p.returncode == 0 else None
    return int(m.group(1)) if m else None


def _worst(outputs: dict):
    """(rel L2, max-abs) of the worst output."""
    if not outputs:
        return None, None
    l2 = max(v[0] for v in outputs.values())
    return l2, max(v[1] for v in outputs.values())


def write_reference_at(model, result, x, path: Path) -> None:
    """PyTorch's outputs on `x` in the reference format, under the names the export gave."""
    import torch

    from kiln_torch import graph as kg

    with torch.no_grad():
        out = model(x)
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    names = list(result.outputs)
    if len(tensors) != len(names):
        raise RuntimeError(f"the model returned {len(tensors)} tensors at batch {x.shape[0]}, {len(names)} when exported")
    inputs = {list(result.inputs)[0]: x.numpy()}
    outputs = {n: t.detach().float().numpy() for n, t in zip(names, tensors)}
    path.write_bytes(kg.encode_reference(inputs, outputs, {"model": result.metadata.get("model", "")}))


def checkout_commit(kiln=None) -> str:
    """The commit the exporter and this tool run at (`-dirty` when python/ or tools/ differ from it).
    A `COMMIT` file beside the kiln binary (tools/gpu-build.sh writes it) wins: a copy of the tree
    on another machine may carry another checkout's git metadata."""
    stamp = Path(kiln).parent / "COMMIT" if kiln else None
    if stamp and stamp.is_file():
        return stamp.read_text().strip() or "unknown"

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--", "python", "tools") else "")


def check(entry: Entry, a, out: Path) -> dict:
    import torch

    import kiln_torch

    row = {"model": entry.name, "source": entry.source, "size": entry.size, "status": "error", "commit": a.commit}
    start = time.time()
    # The model's own limit, within the run's `--budget` (a device call's end is never crossed).
    timeout = max(min(a.timeout, a.stop_at - start), 1)
    stem = entry.name.replace("/", "_")
    path, ref2, ref3 = out / f"{stem}.kiln.safetensors", out / f"{stem}.b{EXPORT_BATCH}.ref.safetensors", out / f"{stem}.b{OTHER_BATCH}.ref.safetensors"
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(int(timeout), 1))
    try:
        torch.manual_seed(0)
        model = entry.build().eval()
        row["family"] = entry.family or type(model).__module__.split(".")[-1]
        row["class"] = type(model).__name__
        row["params"] = sum(p.numel() for p in model.parameters())
        randomise(model)
        gen = torch.Generator().manual_seed(7)
        x2 = torch.rand([EXPORT_BATCH, 3, entry.size, entry.size], generator=gen) * 2 - 1
        x3 = torch.rand([OTHER_BATCH, 3, entry.size, entry.size], generator=gen) * 2 - 1
        t = time.time()
        try:
            result = kiln_torch.export(model, (x2,), path, reference=ref2, model_name=entry.name)
        except kiln_torch.UnsupportedOpsError as e:
            counts = {}
            for m in e.missing:
                counts[m.op] = counts.get(m.op, 0) + 1
            first = e.missing[0]
            row.update(status="unsupported", export="unsupported", unsupported=counts,
                       reason=f"{first.op} at {first.path or '<model>'}: {first.reason}")
            return row
        except Exception as e:  # noqa: BLE001 -- torch.export's own failures: the reason is the row's
            row.update(status="export failed", export="failed", reason=_one_line(f"{type(e).__name__}: {e}"))
            return row
        row["export"] = "ok"
        row["export_s"] = round(time.time() - t, 1)
        if a.gpu:
            # The device's row: the engines and the timings (the CPU checks are this tool's run
            # without --gpu; `--merge` joins the two). The alarm stays set: its Timeout ends a
            # subprocess or a torch.compile that would cross the model's limit.
            row["gpu"] = gpu_check(a, entry, model, result, x2, path, ref2, out, stem, start + timeout)
            if "compile" in row["gpu"]:
                row["compile"] = row["gpu"].pop("compile")
            row["status"] = row["gpu"]["status"]
            if row["gpu"].get("reason"):
                row["reason"] = row["gpu"]["reason"]
            return row
        write_reference_at(model, result, x3, ref3)
        signal.alarm(0)
        del model
        remaining = timeout - (time.time() - start)
        t = time.time()
        for batch, ref in ((EXPORT_BATCH, ref2), (OTHER_BATCH, ref3)):
            c = kiln_compare(a.kiln, path, ref, ["--cpu"], CPU_TOL, out / f"{stem}.report.json", remaining - (time.time() - t))
            row[f"cpu_b{batch}"] = _worst(c.get("outputs"))
            if not c["ok"]:
                row.update(status="fail", reason=f"CPU, batch {batch}: {c['error']}")
                return row
        row["cpu_s"] = round(time.time() - t, 1)
        row["layout_copies"] = layout_copies(a.kiln, path, timeout - (time.time() - start))
        row["status"] = "pass"
        return row
    except Timeout:
        row.update(status="timeout", reason=f"over {timeout:.0f} s")
        return row
    except Exception as e:  # noqa: BLE001 -- the tool's own failure on one model is its row, not the run's end
        row.update(status="error", reason=_one_line(f"{type(e).__name__}: {e}"))
        traceback.print_exc()
        return row
    finally:
        signal.alarm(0)
        row["time_s"] = round(time.time() - start, 1)
        if not a.keep:
            for p in (path, ref2, ref3):
                p.unlink(missing_ok=True)


# ---- the device (`--gpu`): engines against PyTorch, and timings

GPU_BATCHES = (1, 16)  # `kiln bench` and PyTorch's CUDA graph
DRY_BATCHES = (1, 2)  # `--dry-run`: the same plumbing on the CPU, at batches that keep it short
FP16_ERROR_RATIO = 1.2  # Kiln's FP16 rel L2 <= this × PyTorch's own FP16 rel L2 (both against FP32)
FP16_FALLBACK_TOL = 1e-2  # where PyTorch's FP16 output is not finite (kiln compare --fp16's default)
COMPILE_LEAD = 1.2  # torch.compile is timed for every transformer and where Kiln leads by less
COMPILE_MIN_S = 60  # `--and-compile` starts no torch.compile with less of the model's time left
SEGMENTATION_SOURCES = ("torchvision.segmentation", "smp")
# Module classes that make a model a transformer (torch.compile is timed for each).
ATTENTION = re.compile(r"Attention|Attn|Transformer|LambdaLayer", re.I)


def is_transformer(model) -> bool:
    return any(ATTENTION.search(type(m).__name__) for m in model.modules())


def rel_l2(got, want) -> float:
    import numpy as np

    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30))


def argmax_agreement(got: dict, want: dict, source: str):
    """The share of images (a `[N, classes]` output) or pixels (a segmentation model's `[N, classes,
    H, W]`) whose argmax over the classes is PyTorch FP32's, over every such output; None when the
    model has none (a detection backbone's feature maps)."""
    import numpy as np

    agree = total = 0
    for key, w in want.items():
        g = got.get(key)
        if g is None or g.shape != w.shape or w.ndim < 2 or w.shape[1] < 2:
            continue
        if w.ndim == 2 or (w.ndim == 4 and source in SEGMENTATION_SOURCES):
            same = np.argmax(g, 1) == np.argmax(w, 1)
            agree, total = agree + int(same.sum()), total + same.size
    return None if not total else agree / total


def reference_outputs(path: Path) -> dict:
    """`output.<name>` tensors of a reference or `--save-outputs` file, by name."""
    from kiln_torch import graph as kg

    tensors = kg.decode_safetensors(path.read_bytes())[0]
    return {k[len("output."):]: v for k, v in tensors.items() if k.startswith("output.")}


def channels_last(model):
    """The model in channels_last, as PyTorch's fast FP16 runs, when every weight allows it (a 3-D
    convolution's 5-D weight does not: then as it is)."""
    import torch

    try:
        return model.to(memory_format=torch.channels_last)
    except RuntimeError:
        return model


def torch_outputs(model, result, x, dtype, device) -> dict:
    """PyTorch's outputs on `x` in `dtype` on `device` (FP16 channels_last on the GPU, as
    PyTorch's fast FP16 runs), as f32 NumPy under the export's output names."""
    import torch

    # No algorithm search for one run (cuDNN's benchmark mode times every conv's algorithms on a
    # shape's first call: seconds of GPU time a model, and the answer is the same); the timings
    # keep it.
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, benchmark=False):
        out = model(x.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last))
    tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return {n: t.detach().float().cpu().numpy() for n, t in zip(result.outputs, tensors)}


def torch_timings(model, size: int, batches, dtype, device, seconds: float, deadline: float, graph=True) -> dict:
    """Median latency (ms) of one call at each batch: under a CUDA graph (`graph`, on the GPU;
    CUDA events around each replay) after warm-up, for about `seconds` each; eagerly on the CPU
    (`--dry-run`). A batch the deadline leaves no time for is left out."""
    import torch

    times = {}
    for b in batches:
        if time.time() > deadline - 5:
            break
        x = torch.rand([b, 3, size, size], device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        with torch.no_grad():
            if device == "cpu":
                model(x)
                runs = []
                for _ in range(3):
                    t = time.perf_counter()
                    model(x)
                    runs.append((time.perf_counter() - t) * 1e3)
            else:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(3):
                        model(x)
                torch.cuda.current_stream().wait_stream(s)
                if graph:
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        model(x)
                    step = g.replay
                else:
                    step = lambda: model(x)  # noqa: E731 -- torch.compile(mode="reduce-overhead") graphs itself
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                runs, until = [], time.time() + seconds
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                while len(runs) < 10 or (time.time() < min(until, deadline - 5) and len(runs) < 2000):
                    start.record()
                    step()
                    end.record()
                    end.synchronize()
                    runs.append(start.elapsed_time(end))
        runs.sort()
        times[str(b)] = round(runs[len(runs) // 2], 4)
    return times


def timing_cache(a) -> list:
    """`--timing-cache FILE` for the engine builds (`--timing-cache`): the workers of a GPU share one,
    so a layer another model timed at the same shape, precision and batch is not timed again (the
    builds' merge-and-rename writes let them share it)."""
    return ["--timing-cache", str(a.timing_cache)] if a.timing_cache else []


def run_kiln_report(cmd: list, report: Path, deadline: float):
    """Runs a `kiln` command that writes its results as JSON to `report`, within the model's
    `deadline`: the report's contents, or `None` and the error (its output's last line)."""
    what = f"kiln {cmd[1]}"
    report.unlink(missing_ok=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(deadline - time.time() - 5, 1), env=KILN_ENV)
    except subprocess.TimeoutExpired:
        return None, f"{what} ran past the model's time"
    if p.returncode != 0 or not report.exists():
        lines = [line for line in (p.stderr + p.stdout).strip().splitlines() if line.strip()]
        return None, f"{what}: " + (lines[-1].strip() if lines else f"exit {p.returncode}")
    return json.loads(report.read_text()), None


def kiln_bench(a, path: Path, out: Path, stem: str, batches, deadline: float):
    """`kiln bench` of the graph file at `batches` (FP16 engines, CUDA graphs, short runs): median
    ms by batch, and the error's last line when it failed."""
    report = out / f"{stem}.bench.json"
    if a.dry_run:
        mode = ["--cpu", "--iterations", "2", "--duration", "0", "--warmup", "0"]
    else:
        mode = ["--fp16", "--cuda-graphs-only", "--duration", str(a.bench_duration), "--warmup", "100", *timing_cache(a)]
    cmd = [a.kiln, "bench", str(path), *mode, "--batch", ",".join(map(str, batches)), "--json", str(report)]
    records, err = run_kiln_report(cmd, report, deadline)
    if err:
        return {}, err
    records = records if isinstance(records, list) else records.get("records", [])
    return {str(r["batch"]): round(r["median_ms"], 4) for r in records}, None


def kiln_profile(a, path: Path, out: Path, stem: str, deadline: float):
    """`kiln profile` of the graph file's FP16 engine at batch 1: where the time goes, summed by
    layer kind (the `KIND_TOP` largest) and the `LAYER_TOP` slowest layers; the error's last line
    when it failed."""
    report = out / f"{stem}.profile.json"
    cmd = [a.kiln, "profile", str(path), "--fp16", "--batch", "1", "--iterations", "20", "--json", str(report), *timing_cache(a)]
    layers, err = run_kiln_report(cmd, report, deadline)
    return (None, err) if err else (profile_summary(layers), None)


KIND_TOP, LAYER_TOP = 8, 5
COPIES_TOP = 25  # models listed under "The most layout copies"


def profile_summary(layers: list) -> dict:
    """`kiln profile --json`'s layers as a row keeps them: the sum, the time by kind (its first two
    `:` parts without parentheses: `kernel:layer_norm_rows`, `kernel:gemm_x` of `kernel:gemm_x:split2`)
    and the slowest layers."""
    by_kind = {}
    for layer in layers:
        kind = re.sub(r"\(.*?\)", "", ":".join(layer["kind"].split(":")[:2]))
        n, ms = by_kind.get(kind, (0, 0.0))
        by_kind[kind] = (n + 1, ms + layer["time_ms"])
    kinds = sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:KIND_TOP]
    slowest = sorted(layers, key=lambda l: -l["time_ms"])[:LAYER_TOP]
    return {"sum_ms": round(sum(l["time_ms"] for l in layers), 4), "layers": len(layers),
            "by_kind": [{"kind": k, "layers": n, "ms": round(ms, 4)} for k, (n, ms) in kinds],
            "slowest": [{"path": l["path"], "kind": l["kind"], "ms": round(l["time_ms"], 4)} for l in slowest]}


def gpu_check(a, entry: Entry, model, result, x, path: Path, ref: Path, out: Path, stem: str, deadline: float) -> dict:
    """The device's checks of one exported model (`ref`: PyTorch's FP32 outputs at the export
    batch, from the export on the CPU):
    1. an FP32 engine (strict, no TF32): rel L2 <= FP32_TOL;
    2. an FP16 engine: rel L2 <= FP16_ERROR_RATIO × PyTorch's own FP16 rel L2 (its model in FP16,
       channels_last, on the same input), and argmax agreement with FP32 at least PyTorch FP16's;
    3. `kiln bench` (FP16, CUDA graphs) and PyTorch FP16 under a CUDA graph at GPU_BATCHES.
    A failed step is the row's reason; the timings are still taken when the engines built.
    `--dry-run` runs the same steps on the CPU (the CPU executor for both engines, PyTorch FP32 for
    its "FP16"), to test this plumbing without a GPU: its numbers mean nothing."""
    import copy

    import torch

    dry = a.dry_run
    device = "cpu" if dry else "cuda"
    batches = DRY_BATCHES if dry else GPU_BATCHES
    row = {"status": "pass", "commit": a.commit, "dry_run": dry, "transformer": is_transformer(model)}
    if not dry:
        row["device"] = torch.cuda.get_device_name()
    errors = []
    left = lambda: deadline - time.time()  # noqa: E731
    want = reference_outputs(ref)
    steps = row["steps_s"] = {}
    waited = TURNS.waited

    @contextlib.contextmanager
    def step(name, turn):
        t = time.time()
        with turn():
            yield
        steps[name] = round(time.time() - t, 1)

    # 1. FP32
    with step("fp32", TURNS.shared):
        c = kiln_compare(a.kiln, path, ref, ["--cpu"] if dry else ["--fp32", *timing_cache(a)], FP32_TOL, out / f"{stem}.report.json", left())
    row["fp32"] = _worst(c.get("outputs"))
    if not c["ok"]:
        errors.append(f"FP32 engine: {c['error']}")
    # 2. FP16, against PyTorch's FP16
    half = copy.deepcopy(model).to(device=device, dtype=torch.float32 if dry else torch.float16)
    half = channels_last(half).eval()
    dtype = torch.float32 if dry else torch.float16
    with step("torch_fp16", TURNS.shared):
        theirs = torch_outputs(half, result, x, dtype, device)
    row["torch_fp16"] = max((rel_l2(theirs[k], want[k]) for k in want if k in theirs), default=None)
    row["torch_fp16_agree"] = argmax_agreement(theirs, want, entry.source)
    saved = out / f"{stem}.fp16.safetensors"
    with step("fp16", TURNS.shared):
        c = kiln_compare(a.kiln, path, ref, ["--cpu"] if dry else ["--fp16", *timing_cache(a)], 1e9, out / f"{stem}.report.json", left(),
                         save=saved)
    if c.get("outputs") is None or not saved.exists():
        errors.append(f"FP16 engine: {c['error']}")
    else:
        ours = reference_outputs(saved)
        saved.unlink(missing_ok=True)
        row["fp16"] = max((rel_l2(ours[k], want[k]) for k in want if k in ours), default=None)
        row["fp16_agree"] = argmax_agreement(ours, want, entry.source)
        theirs_l2 = row["torch_fp16"]
        if theirs_l2 is not None and math.isfinite(theirs_l2):
            limit, what = FP16_ERROR_RATIO * theirs_l2, f"{FP16_ERROR_RATIO}× PyTorch FP16's {_num(theirs_l2)}"
        else:  # PyTorch's own FP16 overflows: Kiln's is held to the plain FP16 tolerance instead
            limit, what = FP16_FALLBACK_TOL, f"{FP16_FALLBACK_TOL:.0e} (PyTorch FP16 is not finite)"
        if row["fp16"] is None or not math.isfinite(row["fp16"]) or (row["fp16"] > limit and not dry):
            errors.append(f"FP16 engine: rel L2 {_num(row['fp16'])} above {what}")
        theirs_agree, ours_agree = row["torch_fp16_agree"], row["fp16_agree"]
        if theirs_agree is not None and (ours_agree is None or ours_agree < theirs_agree):
            errors.append(f"FP16 engine: argmax agrees on {ours_agree:.4f} of the {'pixels' if entry.source in SEGMENTATION_SOURCES else 'images'}, "
                          f"PyTorch FP16 on {theirs_agree:.4f}")
    # 3. timings
    if c.get("outputs") is not None:  # the FP16 engine builds: timed even when a check failed
        with step("kiln_bench", TURNS.alone):
            row["kiln_ms"], err = kiln_bench(a, path, out, stem, batches, deadline)
        if err:
            errors.append(err)
        with step("torch_graph", TURNS.alone):
            try:
                row["torch_graph_ms"] = torch_timings(half, entry.size, batches, dtype, device, a.torch_seconds, deadline)
            except RuntimeError as e:
                # A model whose forward PyTorch cannot capture in a CUDA graph (a host-to-device copy
                # in it): its eager time stands in, and torch.compile is timed as the peer.
                row["torch_graph_error"] = _one_line(f"{type(e).__name__}: {e}")
                if not dry:
                    torch.cuda.synchronize()
                row["torch_eager_ms"] = torch_timings(half, entry.size, batches, dtype, device, a.torch_seconds, deadline, graph=False)
        # Where Kiln trails PyTorch's CUDA graph (`--profile-below`): its layers' times at batch 1.
        lead = kiln_lead(row)
        if a.profile_below and not dry and lead is not None and lead < a.profile_below:
            with step("kiln_profile", TURNS.alone):
                row["profile_b1"], err = kiln_profile(a, path, out, stem, deadline)
            if err:
                row["profile_error"] = err
        # 4. torch.compile (`--and-compile`), where the issue asks for it: compiled and warmed up
        # beside the other workers' checks, timed alone.
        if a.and_compile and needs_compile(row) and left() > COMPILE_MIN_S:
            t = time.time()
            row["compile"] = compile_timings(a, half, entry.size, dtype, device, deadline)
            steps["compile"] = round(time.time() - t, 1)
    row["waited_s"] = round(TURNS.waited - waited, 1)
    del half
    if not dry:
        torch.cuda.empty_cache()
    if errors:
        row.update(status="fail", reason="; ".join(errors))
    return row


def kiln_lead(gpu: dict):
    """PyTorch's CUDA-graph time over Kiln's, the smaller over the batches both timed."""
    k, t = gpu.get("kiln_ms") or {}, gpu.get("torch_graph_ms") or {}
    leads = [t[b] / k[b] for b in k if b in t and k[b]]
    return min(leads) if leads else None


def needs_compile(gpu: dict) -> bool:
    """torch.compile is timed for every transformer, any model where Kiln leads PyTorch's CUDA
    graph by less than COMPILE_LEAD, and any model PyTorch cannot capture in a CUDA graph."""
    lead = kiln_lead(gpu)
    return bool(gpu.get("transformer")) or (lead is not None and lead < COMPILE_LEAD) or "torch_graph_error" in gpu


def compile_check(a, entry: Entry, out: Path) -> dict:
    """`--compile`: torch.compile (`--compile-mode`, FP16 channels_last) timed at GPU_BATCHES: a row
    of its own, `{"model", "compile": {...}}`, that `--merge` joins to the model's."""
    import torch

    start = time.time()
    deadline = start + max(min(a.timeout, a.stop_at - start), 1)
    row = {"model": entry.name, "source": entry.source, "size": entry.size}
    dry = a.dry_run
    device = "cpu" if dry else "cuda"
    dtype = torch.float32 if dry else torch.float16
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(int(deadline - start), 1))  # a compile that would cross the limit ends in a Timeout
    try:
        torch.manual_seed(0)
        model = entry.build().eval()
        randomise(model)
        model = channels_last(model.to(device=device, dtype=dtype))
        info = compile_timings(a, model, entry.size, dtype, device, deadline)
    except Timeout:
        info = {"status": "timeout", "commit": a.commit, "mode": a.compile_mode, "reason": "over the model's time"}
    except Exception as e:  # noqa: BLE001 -- a model that fails to build is its row
        info = {"status": "error", "commit": a.commit, "mode": a.compile_mode, "reason": _one_line(f"{type(e).__name__}: {e}")}
    finally:
        signal.alarm(0)
    info["time_s"] = round(time.time() - start, 1)
    row["compile"] = info
    return row


def compile_timings(a, model, size: int, dtype, device, deadline: float) -> dict:
    """torch.compile (`--compile-mode`) of `model` (FP16 channels_last) timed at GPU_BATCHES: compiled
    and warmed up at each batch outside the turns (tracing and code generation are CPU work; the
    few forward passes are short bursts beside the other workers), then timed alone."""
    import torch

    dry = a.dry_run
    batches = DRY_BATCHES if dry else GPU_BATCHES
    info = {"status": "pass", "commit": a.commit, "mode": a.compile_mode, "dry_run": dry}
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager") if dry else torch.compile(model, mode=a.compile_mode)
        with torch.no_grad():
            for b in batches:
                x = torch.rand([b, 3, size, size], device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
                for _ in range(3):  # reduce-overhead records its CUDA graph on a later call than the first
                    compiled(x)
            if not dry:
                torch.cuda.synchronize()
        with TURNS.alone():
            info["compile_ms"] = torch_timings(compiled, size, batches, dtype, device, a.torch_seconds, deadline, graph=False)
        if len(info["compile_ms"]) < len(batches):
            info.update(status="timeout", reason=f"torch.compile timed {len(info['compile_ms'])} of the batches in the time left")
    except Timeout:  # the model's limit ended the compile: a later `--compile` run tries again
        info.update(status="timeout", reason="torch.compile ran past the model's time")
    except Exception as e:  # noqa: BLE001 -- a model torch.compile fails on is its row
        info.update(status="error", reason=_one_line(f"{type(e).__name__}: {e}"))
    finally:
        torch._dynamo.reset()
        if not dry:
            torch.cuda.empty_cache()
    return info


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- the table

def _num(v) -> str:
    return "-" if v is None else f"{v:.1e}"


def _params(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1e6:.1f} M" if n >= 1e5 else f"{n / 1e3:.0f} k"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def passes(r: dict, gpu: bool) -> bool:
    """A model passes on the CPU, and, in a table with the device's rows, on the device too."""
    return r["status"] == "pass" and (not gpu or (r.get("gpu") or {}).get("status") == "pass")


def _ms(times: dict, b) -> str:
    v = (times or {}).get(str(b))
    return "-" if v is None else f"{v:.3f}"


def _share(v) -> str:
    return "-" if v is None else f"{v * 100:.2f}%"


def gpu_cells(r: dict) -> list:
    g = r.get("gpu") or {}
    if not g:
        return ["-"] * 8
    k, t, c = g.get("kiln_ms") or {}, g.get("torch_graph_ms") or {}, (r.get("compile") or {}).get("compile_ms") or {}
    lead = kiln_lead(g)
    return [_num((g.get("fp32") or [None])[0]), f"{_num(g.get('fp16'))} / {_num(g.get('torch_fp16'))}",
            f"{_share(g.get('fp16_agree'))} / {_share(g.get('torch_fp16_agree'))}",
            " / ".join(_ms(k, b) for b in GPU_BATCHES),
            " / ".join(_ms(t, b) for b in GPU_BATCHES) if t or "torch_eager_ms" not in g
            else "eager " + " / ".join(_ms(g["torch_eager_ms"], b) for b in GPU_BATCHES) + " (no CUDA graph)",
            " / ".join(_ms(c, b) for b in GPU_BATCHES) if c else "-", "-" if lead is None else f"{lead:.2f}×",
            g.get("status", "-") if g.get("status") == "pass" else f"**{g.get('status')}**: {g.get('reason', '')}"]


def corpus_count(rows: list, gpu: bool):
    """What the `Corpus:` line counts: with device rows, only those of the commit most of them were
    checked at, so that it speaks for one build of Kiln (rows from other commits stay in the
    table). `(gpu, commit, counted, passed)`: whether the table has device rows, that commit, the
    rows counted and how many of them pass."""
    gpu = gpu and any(r.get("gpu") for r in rows)
    commits = Counter(r["gpu"].get("commit") for r in rows if r.get("gpu"))
    commit = commits.most_common(1)[0][0] if gpu else None
    counted = [r for r in rows if (r.get("gpu") or {}).get("commit") == commit] if gpu else rows
    return gpu, commit, counted, sum(1 for r in counted if passes(r, gpu))


def corpus_line(counted: list, passed: int) -> str:
    return f"Corpus: {passed} of {len(counted)} models import and match"


def _models(n: int) -> str:
    """`n` models, in words: "1 model", "104 models"."""
    return f"{n} model" if n == 1 else f"{n} models"


def render(rows: list, gpu: bool) -> str:
    gpu, commit, counted, passed = corpus_count(rows, gpu)
    later = [r["model"] for r in rows if (r.get("gpu") or {}).get("commit") != commit] if gpu else []
    lines = [
        "# The import corpus",
        "",
        "Written by `python3 tools/import_corpus.py` (docs/IMPORT.md, \"The import corpus\"); do not edit by hand.",
        "Each model is exported with kiln-torch at batch 2 (random weights, BatchNorm statistics drawn) and the one",
        f"graph file is run on Kiln's CPU executor at batch {EXPORT_BATCH} and {OTHER_BATCH} against PyTorch on fresh random",
        f"inputs: rel L2 <= {CPU_TOL:.0e} at both (the worst output's rel L2 and max-abs shown). Layout copies: the values an "
        "engine of the graph would read in another layout than they are stored in (`kiln inspect --no-engine`)."
        + (f" On the device (`--gpu`, exported there at batch {EXPORT_BATCH}): an FP32 engine (no TF32) <= {FP32_TOL:.0e}, an FP16 "
           f"engine's rel L2 <= {FP16_ERROR_RATIO}× PyTorch's own FP16 error (both against PyTorch FP32) with argmax agreement "
           "(images, or pixels of a segmentation model) at least PyTorch FP16's; `kiln bench` (FP16, CUDA graphs) and PyTorch "
           f"FP16 channels_last under a CUDA graph at batch {' and '.join(map(str, GPU_BATCHES))} (median ms; lead: PyTorch's "
           "time over Kiln's, the smaller of the batches), torch.compile for transformers and leads under "
           f"{COMPILE_LEAD}×." if gpu else ""),
        "",
        corpus_line(counted, passed) + ".",
        "",
    ]
    if gpu:
        cpu = sum(1 for r in rows if r["status"] == "pass")
        lines += [f"Counted: the {len(counted)} models checked on the device at {commit}, each on the CPU too. "
                  f"The CPU alone: {cpu} of {len(rows)}.", ""]
        if later:
            many = len(later) != 1
            lines += [f"{len(later)} model{'s are' if many else ' is'} not yet checked on the device at {commit} and left out of "
                      "the count (docs/IMPORT_CORPUS.md lists them at its end).", ""]
    commits = {}
    for r in rows:
        commits[r.get("commit", "unknown")] = commits.get(r.get("commit", "unknown"), 0) + 1
    total = sum(r.get("time_s", 0) for r in rows)
    lines += ["Run at " + ", ".join(f"{c} ({_models(n)})" for c, n in commits.items())
              + f"; {total / 60:.0f} minutes in all, one model at a time.", ""]
    if gpu:
        dev = {}
        for r in rows:
            if r.get("gpu"):
                key = (r["gpu"].get("commit", "unknown"), r["gpu"].get("device") or ("the CPU (--dry-run)" if r["gpu"].get("dry_run") else "?"))
                dev[key] = dev.get(key, 0) + 1
        lines += ["On the device at " + ", ".join(f"{c} on {d} ({_models(n)})" for (c, d), n in dev.items()) + ".", ""]
    by_source = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r)
    fails = [r for r in counted if not passes(r, gpu)]
    if fails:
        lines += ["Failures by reason:", ""]
        reasons = {}
        for r in fails:
            if r["status"] == "unsupported":
                key = "unsupported " + ", ".join(sorted(r.get("unsupported", {})))
            elif r["status"] != "pass":
                key = r["status"]
            else:
                key = "device: " + ((r.get("gpu") or {}).get("reason") or "not run").split(":")[0]
            reasons.setdefault(key, []).append(r["model"])
        for key, models in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {_cell(key)} ({len(models)}): {', '.join(models)}")
        lines.append("")
    head = "| model | family | params | input | export | unsupported ops | rel L2 / max-abs, batch 2 | batch 3 | layout copies |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if gpu:
        head += (" FP32 | FP16 / PyTorch FP16 | argmax FP16 / PyTorch | Kiln ms b1 / b16 | PyTorch graph ms | torch.compile ms |"
                 " lead | device |")
        rule += "---|---|---|---|---|---|---|---|"
    head += " time (s) | result |"
    rule += "---|---|"
    for source, group in by_source.items():
        lines += [f"## {source} ({sum(1 for r in group if passes(r, gpu))} of {len(group)})", "", head, rule]
        for r in group:
            unsup = ", ".join(f"{op} ×{n}" for op, n in r.get("unsupported", {}).items()) or "-"
            b2, b3 = r.get(f"cpu_b{EXPORT_BATCH}"), r.get(f"cpu_b{OTHER_BATCH}")
            cells = [r["model"], r.get("family", "-"), _params(r.get("params")), f"{r['size']}²", r.get("export", "-"), unsup,
                     f"{_num(b2[0])} / {_num(b2[1])}" if b2 and b2[0] is not None else "-",
                     f"{_num(b3[0])} / {_num(b3[1])}" if b3 and b3[0] is not None else "-",
                     "-" if r.get("layout_copies") is None else str(r["layout_copies"])]
            if gpu:
                cells += gpu_cells(r)
            result = "pass" if r["status"] == "pass" else f"**{r['status']}**: {r.get('reason', '')}"
            cells += [f"{r.get('time_s', 0):.0f}", result]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    copies = sorted((r for r in rows if r.get("layout_copies")), key=lambda r: -r["layout_copies"])
    if copies:
        none = sum(1 for r in rows if r.get("layout_copies") == 0)
        lines += ["## The most layout copies", "",
                  f"{none} of {len(rows)} models plan none; the {min(len(copies), COPIES_TOP)} with the most (each a value read in another "
                  "layout than it is stored in: `kiln inspect --no-engine` lists them):", "",
                  ", ".join(f"{r['model']} {r['layout_copies']}" for r in copies[:COPIES_TOP]) + ".", ""]
    profiled = [r for r in rows if (r.get("gpu") or {}).get("profile_b1")]
    if profiled:
        lines += ["## Where Kiln trails PyTorch's CUDA graph", "",
                  "`kiln profile` at batch 1 (each layer alone in a CUDA graph): the sum of the layers and the largest kinds.", "",
                  "| model | lead | sum of layers (ms) | layers | time by kind (ms, layers) | slowest layers |", "|---|---|---|---|---|---|"]
        for r in sorted(profiled, key=lambda r: kiln_lead(r["gpu"]) or 0):
            p = r["gpu"]["profile_b1"]
            kinds = ", ".join(f"{k['kind']} {k['ms']:.3f} ({k['layers']})" for k in p["by_kind"])
            slow = ", ".join(f"{l['path']} {l['ms']:.3f}" for l in p["slowest"])
            lines.append("| " + " | ".join(_cell(c) for c in [r["model"], f"{kiln_lead(r['gpu']):.2f}×", f"{p['sum_ms']:.3f}",
                                                               str(p["layers"]), kinds, slow]) + " |")
        lines.append("")
    if later:
        lines += [f"## Not yet checked on the device at {commit}", "", ", ".join(later) + ".", ""]
    skipped = ", ".join(f"{n} ({why})" for n, why in TORCHVISION_SKIPPED.items())
    lines += [f"Not in the corpus (too large for the CPU time box): {skipped}.", ""]
    return "\n".join(lines)


SUMMARY_BEGIN = "<!-- corpus summary: written by tools/import_corpus.py from docs/import_corpus.json -->"
SUMMARY_END = "<!-- end of the corpus summary -->"


def write_summary(rows: list, gpu: bool, doc: Path = ROOT / "docs" / "IMPORT.md") -> None:
    """The corpus line and the failures by reason, between the markers of docs/IMPORT.md's "The
    import corpus" (the table itself is docs/IMPORT_CORPUS.md's)."""
    text = doc.read_text()
    if SUMMARY_BEGIN not in text or SUMMARY_END not in text:
        return
    table = render(rows, gpu).splitlines()
    first = next(i for i, line in enumerate(table) if line.startswith("Corpus: "))
    last = next((i for i, line in enumerate(table) if line.startswith("## ")), len(table))
    body = "\n".join(table[first:last]).strip()
    head, rest = text.split(SUMMARY_BEGIN, 1)
    tail = rest.split(SUMMARY_END, 1)[1]
    doc.write_text(f"{head}{SUMMARY_BEGIN}\n{body}\n{SUMMARY_END}{tail}")


def load_rows(path: Path) -> list:
    if not path.exists():
        return []
    return json.loads(path.read_text())["models"]


def save_rows(path: Path, rows: list, gpu: bool, stopped=None) -> None:
    """Written whole to a temporary file, then renamed: a run killed mid-write keeps the last rows."""
    data = {"gpu": gpu, "models": rows}
    if stopped:
        data["not_run"] = stopped
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help="corpus names (resnet18, timm/convnext_atto); default: all")
    p.add_argument("--subset", choices=sorted(SUBSETS), help="a fixed small subset")
    p.add_argument("--kiln", default=os.environ.get("KILN", str(ROOT / "target" / "release" / "kiln")),
                   help="the kiln CLI (default: $KILN, else target/release/kiln)")
    p.add_argument("--out", default="/tmp/kiln-import-corpus", help="graph files, references and scratch")
    p.add_argument("--results", default=None, help=f"the JSON results (default: {RESULTS.relative_to(ROOT)}, or OUT/results.json "
                   "for a subset or named models)")
    p.add_argument("--table", default=None, help=f"the Markdown table (default: {TABLE.relative_to(ROOT)} for the whole corpus, "
                   "OUT/IMPORT_CORPUS.md otherwise)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per model, export and checks")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run: no model starts when less than "
                   "--reserve is left, and each model's limit ends by then (a device call never loses its rows)")
    p.add_argument("--reserve", type=float, default=45, help="seconds a model needs at least to be started (with --budget); "
                   "the median model so far counts when longer. A model the budget's end cuts short leaves no row "
                   "(the next call runs it)")
    p.add_argument("--resume", action="store_true", help="keep the results already in the JSON and run only the other models")
    p.add_argument("--resume-from", nargs="+", metavar="JSON", default=[], help="skip the models these results files hold "
                   "a row for of this run's kind (--gpu: a device row; --compile: a torch.compile row), e.g. the merged "
                   "docs/import_corpus.json carried to the device")
    p.add_argument("--gpu", action="store_true", help="the device's run: export at batch 2, FP32 and FP16 engines against "
                   "PyTorch FP32 and FP16, kiln bench and PyTorch's CUDA graph at batch 1 and 16 (needs a GPU but for --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="with --gpu or --compile: the same steps on the CPU (CPU executor, "
                   "PyTorch FP32, eager timings at batch 1 and 2), to test the plumbing without CUDA; numbers mean nothing")
    p.add_argument("--compile", action="store_true", help="the device's torch.compile run (slow, so a shard of its own): every "
                   "transformer and every model where Kiln leads PyTorch's CUDA graph by < 1.2x, read from --resume-from's "
                   "device rows")
    p.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile's mode (default reduce-overhead, "
                   "the peer of the benchmark tables)")
    p.add_argument("--and-compile", action="store_true", help="with --gpu: time torch.compile too, in the same pass, "
                   "for every transformer and every model where Kiln leads PyTorch's CUDA graph by < 1.2x")
    p.add_argument("--turns", metavar="DIR", help="with --gpu: workers sharing a GPU take turns through lock files in DIR "
                   "(the checks together, each timing alone); tools/import-corpus-gpu.sh gives one per GPU")
    p.add_argument("--checks-alone", action="store_true", help="with --turns: the checks (engine builds and runs) take the "
                   "GPU alone too, as the timings do: CUDA time-slices processes, so tactic timing beside another "
                   "process's work crawls (on an H200, six workers sharing the checks ran one model in 50-300 s)")
    p.add_argument("--claims", metavar="DIR", help="workers of one run share the models: each runs the ones it is first "
                   "to claim in DIR (instead of --shard's fixed split)")
    p.add_argument("--profile-below", type=float, default=1.0, metavar="LEAD",
                   help="with --gpu: `kiln profile` (batch 1) of each model Kiln leads PyTorch's CUDA graph by less than "
                   "LEAD (0: none); the row keeps the time by layer kind and the slowest layers")
    p.add_argument("--timing-cache", metavar="FILE", help="with --gpu: the engine builds' timing cache (kiln --timing-cache), "
                   "shared by the workers of a GPU")
    p.add_argument("--kiln-libs", default=os.environ.get("KILN_LIBS", DEVICE_LIBS),
                   help="LD_LIBRARY_PATH of the kiln subprocesses with --gpu (the system cuDNN; PyTorch keeps its own)")
    p.add_argument("--bench-duration", type=float, default=0.3, help="kiln bench --duration at each batch (--gpu; "
                   "a few hundred CUDA-graph replays of a small model)")
    p.add_argument("--torch-seconds", type=float, default=0.3, help="seconds of PyTorch timing at each batch (--gpu)")
    p.add_argument("--keep", action="store_true", help="keep the graph files and references")
    p.add_argument("--render", action="store_true", help="only rewrite the table from the JSON")
    p.add_argument("--list", action="store_true", help="print the corpus and exit")
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    p.add_argument("--shard", metavar="K/N", help="only every N-th model of the corpus, from the K-th (1-based)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these results (a later file's row wins) into the results "
                   "and the table, in corpus order")
    a = p.parse_args()
    global TURNS
    TURNS = GpuTurns(a.turns, checks_alone=a.checks_alone)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    a.start = time.time()
    a.stop_at = a.start + a.budget if a.budget else math.inf
    if a.dry_run and not (a.gpu or a.compile):
        p.error("--dry-run goes with --gpu or --compile")
    if a.gpu and a.compile:
        p.error("--gpu and --compile are separate runs (torch.compile is budgeted on its own)")
    device = a.gpu or a.compile
    if a.gpu and not a.dry_run:
        global KILN_ENV
        KILN_ENV = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        if a.kiln_libs:
            KILN_ENV["LD_LIBRARY_PATH"] = a.kiln_libs
    # The device's runs write only OUT/results.json: the CPU table is this tool's run here.
    whole = not a.models and not a.subset and not a.shard and not device
    results = Path(a.results) if a.results else (RESULTS if whole else out / "results.json")
    table = Path(a.table) if a.table else (TABLE if whole else out / "IMPORT_CORPUS.md")
    if a.render:
        rows = load_rows(results)
        gpu = json.loads(results.read_text()).get("gpu", False)
        table.write_text(render(rows, gpu))
        if results == RESULTS:
            write_summary(rows, gpu)
        print(f"wrote {table} ({len(rows)} models)")
        return 0
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    a.commit = checkout_commit(a.kiln)
    entries = corpus()
    if a.merge:
        return merge(a.merge, entries, results, table)
    if a.list:
        for e in entries:
            print(f"{e.name}\t{e.source}\t{e.size}")
        print(f"{len(entries)} models")
        return 0
    names = SUBSETS[a.subset] if a.subset else a.models
    if names:
        known = {e.name: e for e in entries}
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"import_corpus: not in the corpus: {', '.join(unknown)} (--list names them)", file=sys.stderr)
            return 2
        entries = [known[n] for n in names]
    if a.shard:
        k, n = shard_of(a.shard)
        entries = entries[k - 1 :: n]
    if not a.compile and not Path(a.kiln).exists():
        print(f"import_corpus: no kiln CLI at {a.kiln}: cargo build --release -p kiln-cli, or --kiln PATH", file=sys.stderr)
        return 2
    if device and not a.dry_run:
        if not torch.cuda.is_available():
            print("import_corpus: --gpu and --compile need CUDA, which torch does not see (--dry-run runs their steps on the CPU)",
                  file=sys.stderr)
            return 2
        # PyTorch at its fastest: cuDNN's algorithm search, as tools/bench_torch.py runs it.
        torch.backends.cudnn.benchmark = True
    kind = "compile" if a.compile else "gpu" if a.gpu else None
    carried = {}
    for path in a.resume_from:
        for r in load_rows(Path(path)):
            carried.setdefault(r["model"], {}).update(r)
    if a.compile:
        # Only the models the issue asks torch.compile of, by the carried device rows.
        entries = [e for e in entries if needs_compile(carried.get(e.name, {}).get("gpu") or {})]
    rows = load_rows(results) if (a.resume or not whole) else []
    done = {r["model"] for r in rows} if a.resume else set()
    # A device row counts only at the kiln CLI's own commit: the corpus's device rows all come from
    # one commit, so a row from an older binary is run again.
    done |= {m for m, r in carried.items() if kind and settled(r.get(kind), a.commit)}
    order = {e.name: i for i, e in enumerate(corpus_order(entries, rows))}
    todo = [e for e in entries if e.name not in done]
    times, stopped, cut = [], [], []
    for n, e in enumerate(todo):
        left = a.stop_at - time.time()
        typical = sorted(times)[len(times) // 2] if times else 0.0
        if left < max(a.reserve, typical):
            stopped = [t.name for t in todo[n:] if not a.claims or not claim_file(a.claims, t.name).exists()]
            print(f"import_corpus: {left:.0f} s of the budget left, under the {max(a.reserve, typical):.0f} s a model may take: "
                  f"stopping before {len(stopped)} models ({', '.join(stopped[:5])}{', ...' if len(stopped) > 5 else ''})", flush=True)
            break
        if not claim(a.claims, e.name):
            continue
        print(f"[{n + 1}/{len(todo)}] {e.name} ...", end=" ", flush=True)
        row = compile_check(a, e, out) if a.compile else check(e, a, out)
        status = row["compile"]["status"] if a.compile else row["status"]
        if ended_by_budget(a, status, row.get("time_s") or 0):
            cut.append(e.name)
            print(f"cut short by the budget's end ({row.get('reason') or row.get('compile', {}).get('reason', '')}): no row, "
                  "the next call runs it", flush=True)
            continue
        if a.gpu and ended_by_budget(a, (row.get("compile") or {}).get("status", "pass"), 0):
            row.pop("compile")  # the engines' checks stand; torch.compile is timed by a later call
        # What a model takes, without torch.compile: a compile cut short by the budget's end leaves
        # the row (a `--compile` run times it), so the next model needs only the checks' time.
        spent = row.get("time_s", 0) - ((row.get("gpu") or {}).get("steps_s") or {}).get("compile", 0)
        times.append(spent or row.get("compile", {}).get("time_s", 0))
        rows = [r for r in rows if r["model"] != e.name] + [row]
        rows.sort(key=lambda r: order.get(r["model"], len(order)))
        save_rows(results, rows, a.gpu or a.compile, stopped=None)
        reason = row["compile"].get("reason", "") if a.compile else row.get("reason", "")
        b2 = row.get(f"cpu_b{EXPORT_BATCH}") or [None]
        print(f"{status} ({row['compile']['time_s'] if a.compile else row['time_s']:.0f} s){'' if status == 'pass' else ': ' + reason}"
              + (f" rel L2 {b2[0]:.1e}" if b2[0] is not None else "") + (f" {_gpu_line(row['gpu'])}" if row.get("gpu") else ""),
              flush=True)
    save_rows(results, rows, a.gpu or a.compile, stopped=cut + stopped)
    if a.compile:
        print(f"torch.compile: {sum(1 for r in rows if r.get('compile', {}).get('status') == 'pass')} of {len(rows)} models timed; "
              f"wrote {results}")
        return 0
    shown = [r for r in rows if r["model"] in {e.name for e in entries}] if not whole else rows
    table.write_text(render(shown, a.gpu))
    if whole and results.resolve() == RESULTS.resolve():
        # docs/IMPORT.md's summary speaks for docs/import_corpus.json alone: a run elsewhere
        # (`--results`) reaches it through `--merge`, which keeps the device rows.
        write_summary(shown, a.gpu)
    passed = sum(1 for r in shown if r["status"] == "pass")
    print(f"{corpus_line(*corpus_count(shown, a.gpu)[2:])}; wrote {table} and {results}")
    return 0 if passed == len(shown) else 1


def settled(result, commit: str) -> bool:
    """Whether a device (`gpu`) or torch.compile result needs no further run at `commit`: any
    result from that commit but a torch.compile that ran out of time (a `--compile` run gives it a
    model's whole limit)."""
    return bool(result) and result.get("commit") == commit and result.get("status") != "timeout"


def ended_by_budget(a, status: str, seconds: float) -> bool:
    """Whether a step that did not pass (`status`, after `seconds`) was ended by the run's budget
    rather than by its own limit or a fault of its own: it ended within 10 s of the budget's end,
    before `--timeout`."""
    return status != "pass" and a.stop_at - time.time() < 10 and seconds < a.timeout


def _gpu_line(g: dict) -> str:
    k, t = g.get("kiln_ms") or {}, g.get("torch_graph_ms") or {}
    times = " ".join(f"b{b}: {k[b]:.3f}/{t.get(b, math.nan):.3f} ms" for b in k)
    return f"FP32 {_num((g.get('fp32') or [None])[0])} FP16 {_num(g.get('fp16'))} (PyTorch {_num(g.get('torch_fp16'))}) {times}"


def shard_of(text: str):
    """`K/N` → (K, N), 1 <= K <= N."""
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise SystemExit(f"import_corpus: --shard {text!r}: expected K/N, e.g. 2/4") from None
    if not 1 <= k <= n:
        raise SystemExit(f"import_corpus: --shard {text!r}: K must be 1 to N")
    return k, n


def merge(paths, entries, results: Path, table: Path) -> int:
    """The rows of several results files as one, in corpus order. A CPU run's row of a model
    replaces the one before it (keeping its device results); a device run's row (a file written
    with --gpu or --compile) adds its `gpu` or `compile` results to the model's row (an export that
    failed there is its `gpu` result)."""
    by_model, gpu = {}, False
    for path in paths:
        data = json.loads(Path(path).read_text())
        device = data.get("gpu", False)
        gpu = gpu or device
        for r in data["models"]:
            base = by_model.get(r["model"])
            if not device or base is None:
                if base is not None:
                    r = dict(r, **{k: base[k] for k in ("gpu", "compile") if k in base and k not in r})
                by_model[r["model"]] = r
                continue
            if "compile" in r:
                base["compile"] = r["compile"]
            if "gpu" in r:
                base["gpu"] = r["gpu"]
            elif "compile" not in r:
                base["gpu"] = {"status": r["status"], "reason": f"export on the device: {r.get('reason', '')}", "commit": r.get("commit")}
    order = {e.name: i for i, e in enumerate(entries)}
    rows = sorted(by_model.values(), key=lambda r: order.get(r["model"], len(order)))
    save_rows(results, rows, gpu)
    table.write_text(render(rows, gpu))
    write_summary(rows, gpu)
    missing = [e.name for e in entries if e.name not in by_model]
    print(f"{corpus_line(*corpus_count(rows, gpu)[2:])}; wrote {table} and {results}"
          + (f"; not in any file: {', '.join(missing)}" if missing else ""))
    return 0


def corpus_order(entries, rows):
    """The corpus order of `entries`, then models of `rows` not among them."""
    names = {e.name for e in entries}
    return list(entries) + [Entry(r["model"], r["source"], r["size"]) for r in rows if r["model"] not in names]


if __name__ == "__main__":
    sys.exit(main())
