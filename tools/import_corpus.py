"""The import corpus (issue 42): vision models this project never named, each exported with kiln-torch
at batch 2 and checked against PyTorch from the same graph file at batch 2 and 3.

The corpus: every torchvision classification model (`torchvision.models.list_models`) but the few too
large for a CPU run, torchvision's segmentation models, the backbones of its detection models, and
timm models across families. Random initialisation (`pretrained=False`, `weights=None`: nothing is
downloaded), BatchNorm statistics and affine parameters drawn (so that folding them is exercised),
weights PyTorch initialises to zeros (ViT heads) drawn too, fresh random inputs in [-1, 1].

For each model:
1. export it with kiln-torch at batch 2, with PyTorch's outputs as a reference (an unsupported op is
   the report's op names and first reason, not a crash);
2. write a second reference at batch 3 from PyTorch;
3. `kiln compare FILE --reference REF --cpu` at both batches (the same graph file): relative L2 and
   max-abs of every output; a model passes when every output is within 1e-5 at both batches.

With `--gpu` (on a machine with a GPU), each graph file is also compared in an FP32 engine (strict
FP32, no TF32: `kiln compare --fp32`, rel L2 <= 1e-4) and in an FP16 engine (`--fp16`, rel L2 <=
1e-2 and the same top-1 class as PyTorch for every image of a `[N, classes]` output), at batch 2.

Results go to `--out`/results.json after every model (`--resume` skips the models already there),
and the table to docs/IMPORT_CORPUS.md (written by this script; `--render` rewrites it from the
JSON alone). One model at a time, each under `--timeout` seconds.

    python3 tools/import_corpus.py                      # the whole corpus (CPU)
    python3 tools/import_corpus.py --subset smoke       # 4 models, a minute or two
    python3 tools/import_corpus.py resnet18 timm/convnext_atto --out /tmp/corpus
    python3 tools/import_corpus.py --gpu --kiln .carry/kiln/kiln   # on the device
    python3 tools/import_corpus.py --render             # the table from the JSON alone

On the device, where each call gets a fresh machine, `--shard K/N` runs every N-th model (from the
K-th) end to end into OUT/results.json, and `--merge` joins the shards' results into one table:

    python3 tools/import_corpus.py --gpu --shard 1/4 --out $OUT/corpus   # one device call each
    python3 tools/import_corpus.py --merge shard1/results.json shard2/results.json ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "docs" / "IMPORT_CORPUS.md"
RESULTS = ROOT / "docs" / "import_corpus.json"

CPU_TOL, FP32_TOL, FP16_TOL = 1e-5, 1e-4, 1e-2
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


def kiln_compare(kiln: str, path: Path, ref: Path, flags: list, tol: float, report: Path, timeout: float, save=None) -> dict:
    """`kiln compare` of `path` against `ref`: {ok, outputs: {name: (rel_l2, max_abs)}, error}."""
    cmd = [kiln, "compare", str(path), "--reference", str(ref), *flags, "--l2-tol", str(tol), "--report", str(report)]
    if save is not None:
        cmd += ["--save-outputs", str(save)]
    report.unlink(missing_ok=True)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"kiln compare {' '.join(flags)} ran past the timeout"}
    if not report.exists():
        lines = [l for l in (p.stderr + p.stdout).strip().splitlines() if l.strip()]
        err = next((l for l in lines if l.startswith("error")), lines[-1] if lines else f"exit {p.returncode}")
        return {"ok": False, "error": f"kiln compare: {err.strip()}"}
    r = json.loads(report.read_text())
    outs = {o["name"]: [o["rel_l2"], o["max_abs"]] for o in r["outputs"]}
    return {"ok": bool(r["pass"]), "outputs": outs, "error": None if r["pass"] else f"rel L2 above {tol:.0e}"}


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


def checkout_commit() -> str:
    """The commit the exporter and this tool run at (`-dirty` when python/ or tools/ differ from it)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--", "python", "tools") else "")


def check(entry: Entry, a, out: Path) -> dict:
    import torch

    import kiln_torch

    row = {"model": entry.name, "source": entry.source, "size": entry.size, "status": "error", "commit": a.commit}
    start = time.time()
    stem = entry.name.replace("/", "_")
    path, ref2, ref3 = out / f"{stem}.kiln.safetensors", out / f"{stem}.b{EXPORT_BATCH}.ref.safetensors", out / f"{stem}.b{OTHER_BATCH}.ref.safetensors"
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(a.timeout))
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
        write_reference_at(model, result, x3, ref3)
        signal.alarm(0)
        del model
        remaining = a.timeout - (time.time() - start)
        t = time.time()
        for batch, ref in ((EXPORT_BATCH, ref2), (OTHER_BATCH, ref3)):
            c = kiln_compare(a.kiln, path, ref, ["--cpu"], CPU_TOL, out / f"{stem}.report.json", remaining - (time.time() - t))
            row[f"cpu_b{batch}"] = _worst(c.get("outputs"))
            if not c["ok"]:
                row.update(status="fail", reason=f"CPU, batch {batch}: {c['error']}")
                return row
        row["cpu_s"] = round(time.time() - t, 1)
        if a.gpu:
            gpu = gpu_check(a, path, ref2, out, stem, a.timeout)
            row.update(gpu)
            if gpu.get("gpu_error"):
                row.update(status="fail", reason=gpu["gpu_error"])
                return row
        row["status"] = "pass"
        return row
    except Timeout:
        row.update(status="timeout", reason=f"over {a.timeout:.0f} s")
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


def gpu_check(a, path: Path, ref: Path, out: Path, stem: str, timeout: float) -> dict:
    """FP32 (strict, no TF32) and FP16 engines against PyTorch's f32 outputs at the export batch;
    FP16 also keeps every image's top-1 class of a `[N, classes]` output."""
    import numpy as np

    from kiln_torch import graph as kg

    row = {}
    c = kiln_compare(a.kiln, path, ref, ["--fp32"], FP32_TOL, out / f"{stem}.report.json", timeout)
    row["fp32"] = _worst(c.get("outputs"))
    if not c["ok"]:
        row["gpu_error"] = f"FP32 engine: {c['error']}"
        return row
    saved = out / f"{stem}.fp16.safetensors"
    c = kiln_compare(a.kiln, path, ref, ["--fp16"], FP16_TOL, out / f"{stem}.report.json", timeout, save=saved)
    row["fp16"] = _worst(c.get("outputs"))
    if not c["ok"]:
        row["gpu_error"] = f"FP16 engine: {c['error']}"
        return row
    got, want = kg.decode_safetensors(saved.read_bytes())[0], kg.decode_safetensors(ref.read_bytes())[0]
    saved.unlink(missing_ok=True)
    for key, r in want.items():
        if not key.startswith("output.") or r.ndim != 2 or r.shape[1] < 2 or key not in got:
            continue
        agree = int(np.sum(np.argmax(got[key], 1) == np.argmax(r, 1)))
        row["fp16_top1"] = f"{agree}/{r.shape[0]}"
        if agree != r.shape[0]:
            row["gpu_error"] = f"FP16 engine: top-1 of {key[7:]} differs on {r.shape[0] - agree} of {r.shape[0]} images"
    return row


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


def render(rows: list, gpu: bool) -> str:
    passed = sum(1 for r in rows if r["status"] == "pass")
    lines = [
        "# The import corpus",
        "",
        "Written by `python3 tools/import_corpus.py` (docs/IMPORT.md, \"The import corpus\"); do not edit by hand.",
        "Each model is exported with kiln-torch at batch 2 (random weights, BatchNorm statistics drawn) and the one",
        f"graph file is run on Kiln's CPU executor at batch {EXPORT_BATCH} and {OTHER_BATCH} against PyTorch on fresh random",
        f"inputs: rel L2 <= {CPU_TOL:.0e} at both (the worst output's rel L2 and max-abs shown)."
        + (f" GPU: FP32 engine (no TF32) <= {FP32_TOL:.0e}, FP16 <= {FP16_TOL:.0e} with the same top-1." if gpu else ""),
        "",
        f"Corpus: {passed} of {len(rows)} models import and match.",
        "",
    ]
    commits = {}
    for r in rows:
        commits[r.get("commit", "unknown")] = commits.get(r.get("commit", "unknown"), 0) + 1
    total = sum(r.get("time_s", 0) for r in rows)
    lines += ["Run at " + ", ".join(f"{c} ({n} models)" for c, n in commits.items())
              + f"; {total / 60:.0f} minutes in all, one model at a time.", ""]
    by_source = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r)
    fails = [r for r in rows if r["status"] != "pass"]
    if fails:
        lines += ["Failures by reason:", ""]
        reasons = {}
        for r in fails:
            key = r["status"] if r["status"] != "unsupported" else "unsupported " + ", ".join(sorted(r.get("unsupported", {})))
            reasons.setdefault(key, []).append(r["model"])
        for key, models in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"- {_cell(key)} ({len(models)}): {', '.join(models)}")
        lines.append("")
    head = "| model | family | params | input | export | unsupported ops | rel L2 / max-abs, batch 2 | batch 3 |"
    rule = "|---|---|---|---|---|---|---|---|"
    if gpu:
        head += " FP32 | FP16 | FP16 top-1 |"
        rule += "---|---|---|"
    head += " time (s) | result |"
    rule += "---|---|"
    for source, group in by_source.items():
        lines += [f"## {source} ({sum(1 for r in group if r['status'] == 'pass')} of {len(group)})", "", head, rule]
        for r in group:
            unsup = ", ".join(f"{op} ×{n}" for op, n in r.get("unsupported", {}).items()) or "-"
            b2, b3 = r.get(f"cpu_b{EXPORT_BATCH}"), r.get(f"cpu_b{OTHER_BATCH}")
            cells = [r["model"], r.get("family", "-"), _params(r.get("params")), f"{r['size']}²", r.get("export", "-"), unsup,
                     f"{_num(b2[0])} / {_num(b2[1])}" if b2 and b2[0] is not None else "-",
                     f"{_num(b3[0])} / {_num(b3[1])}" if b3 and b3[0] is not None else "-"]
            if gpu:
                cells += [_num((r.get("fp32") or [None])[0]), _num((r.get("fp16") or [None])[0]), r.get("fp16_top1", "-")]
            result = "pass" if r["status"] == "pass" else f"**{r['status']}**: {r.get('reason', '')}"
            cells += [f"{r.get('time_s', 0):.0f}", result]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("")
    skipped = ", ".join(f"{n} ({why})" for n, why in TORCHVISION_SKIPPED.items())
    lines += [f"Not in the corpus (too large for the CPU time box): {skipped}.", ""]
    return "\n".join(lines)


def load_rows(path: Path) -> list:
    if not path.exists():
        return []
    return json.loads(path.read_text())["models"]


def save_rows(path: Path, rows: list, gpu: bool) -> None:
    path.write_text(json.dumps({"gpu": gpu, "models": rows}, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help="corpus names (resnet18, timm/convnext_atto); default: all")
    p.add_argument("--subset", choices=sorted(SUBSETS), help="a fixed small subset")
    p.add_argument("--kiln", default=str(ROOT / "target" / "release" / "kiln"))
    p.add_argument("--out", default="/tmp/kiln-import-corpus", help="graph files, references and scratch")
    p.add_argument("--results", default=None, help=f"the JSON results (default: {RESULTS.relative_to(ROOT)}, or OUT/results.json "
                   "for a subset or named models)")
    p.add_argument("--table", default=None, help=f"the Markdown table (default: {TABLE.relative_to(ROOT)} for the whole corpus, "
                   "OUT/IMPORT_CORPUS.md otherwise)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per model, export and checks")
    p.add_argument("--resume", action="store_true", help="keep the results already in the JSON and run only the other models")
    p.add_argument("--gpu", action="store_true", help="also check FP32 and FP16 engines (needs a GPU)")
    p.add_argument("--keep", action="store_true", help="keep the graph files and references")
    p.add_argument("--render", action="store_true", help="only rewrite the table from the JSON")
    p.add_argument("--list", action="store_true", help="print the corpus and exit")
    p.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    p.add_argument("--shard", metavar="K/N", help="only every N-th model of the corpus, from the K-th (1-based)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="join these results (a later file's row wins) into the results "
                   "and the table, in corpus order")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    whole = not a.models and not a.subset and not a.shard
    results = Path(a.results) if a.results else (RESULTS if whole else out / "results.json")
    table = Path(a.table) if a.table else (TABLE if whole else out / "IMPORT_CORPUS.md")
    if a.render:
        rows = load_rows(results)
        table.write_text(render(rows, json.loads(results.read_text()).get("gpu", False)))
        print(f"wrote {table} ({len(rows)} models)")
        return 0
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    a.commit = checkout_commit()
    entries = corpus()
    if a.merge:
        return merge(a.merge, entries, results, table)
    if a.list:
        for e in entries:
            print(f"{e.name}\t{e.source}\t{e.size}")
        print(f"{len(entries)} models")
        return 0
    if a.shard:
        k, n = shard_of(a.shard)
        entries = entries[k - 1 :: n]
    names = SUBSETS[a.subset] if a.subset else a.models
    if names:
        known = {e.name: e for e in entries}
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"import_corpus: not in the corpus: {', '.join(unknown)} (--list names them)", file=sys.stderr)
            return 2
        entries = [known[n] for n in names]
    if not a.render and not Path(a.kiln).exists():
        print(f"import_corpus: no kiln CLI at {a.kiln}: cargo build --release -p kiln-cli, or --kiln PATH", file=sys.stderr)
        return 2
    rows = load_rows(results) if (a.resume or not whole) else []
    done = {r["model"] for r in rows} if a.resume else set()
    order = {e.name: i for i, e in enumerate(corpus_order(entries, rows))}
    for e in entries:
        if e.name in done:
            continue
        print(f"[{len(done) + 1}/{len(entries)}] {e.name} ...", end=" ", flush=True)
        row = check(e, a, out)
        rows = [r for r in rows if r["model"] != e.name] + [row]
        rows.sort(key=lambda r: order.get(r["model"], len(order)))
        done.add(e.name)
        save_rows(results, rows, a.gpu)
        b2 = row.get(f"cpu_b{EXPORT_BATCH}") or [None]
        print(f"{row['status']} ({row['time_s']:.0f} s){'' if row['status'] == 'pass' else ': ' + row.get('reason', '')}"
              + (f" rel L2 {b2[0]:.1e}" if b2[0] is not None else ""), flush=True)
    shown = [r for r in rows if r["model"] in {e.name for e in entries}] if not whole else rows
    table.write_text(render(shown, a.gpu))
    passed = sum(1 for r in shown if r["status"] == "pass")
    print(f"Corpus: {passed} of {len(shown)} models import and match; wrote {table} and {results}")
    return 0 if passed == len(shown) else 1


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
    """The rows of several results files as one (a later file's row of a model wins), in corpus order."""
    by_model, gpu = {}, False
    for path in paths:
        data = json.loads(Path(path).read_text())
        gpu = gpu or data.get("gpu", False)
        for r in data["models"]:
            by_model[r["model"]] = r
    order = {e.name: i for i, e in enumerate(entries)}
    rows = sorted(by_model.values(), key=lambda r: order.get(r["model"], len(order)))
    save_rows(results, rows, gpu)
    table.write_text(render(rows, gpu))
    missing = [e.name for e in entries if e.name not in by_model]
    passed = sum(1 for r in rows if r["status"] == "pass")
    print(f"Corpus: {passed} of {len(rows)} models import and match; wrote {table} and {results}"
          + (f"; not in any file: {', '.join(missing)}" if missing else ""))
    return 0


def corpus_order(entries, rows):
    """The corpus order of `entries`, then models of `rows` not among them."""
    names = {e.name for e in entries}
    return list(entries) + [Entry(r["model"], r["source"], r["size"]) for r in rows if r["model"] not in names]


if __name__ == "__main__":
    sys.exit(main())
