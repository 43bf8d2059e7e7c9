"""Quantised PyTorch models in Kiln (issue 38 item 4): PT2E-quantised torchvision models and a model
with fake-quant modules, exported with kiln-torch, checked against PyTorch's quantised model on
Kiln's CPU simulation of the INT8 engine. Needs torch, torchvision and torchao (not in CI).

    PYTHONPATH=python python tools/pt2e_check.py --kiln target/release/kiln --out target/pt2e
    PYTHONPATH=python python tools/pt2e_check.py --fixtures tests/fixtures/pt2e   # the CI fixtures only

For each model: PT2E (`torchao.quantization.pt2e`: `prepare_pt2e`, calibration, `convert_pt2e`)
with XNNPACKQuantizer's per-channel config (int8 weights per output channel in [-127, 127];
activations int8 per tensor in [-128, 127], made symmetric here, zero point 0, as TensorRT's and
Kiln's 8-bit layers want them; `--affine` also runs XNNPACK's own affine activations). The photos
(sorted by name) are two halves: the even places calibrate (each as its 256/224 centre crop and its
mirror image, plus two structured images), the odd places are judged (4 views each: the centre
crop, its mirror, a closer 288/224 crop and its mirror). PyTorch's converted model (the reference
quantised model, run in PyTorch) gives the reference logits; `kiln compare <graph> --cpu --int8`
runs Kiln's CPU simulation of the INT8 engine built from the graph's own Q/DQ nodes. Prints rel L2
and max-abs of the logits, top-1 agreement with PyTorch's quantised model (and, for context,
PyTorch's quantised model against its FP32 model), and whether `kiln build --int8` accepts the
graph (without a GPU it stops where it needs one).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

import kiln_torch  # noqa: E402
from kiln_torch import graph as kg  # noqa: E402

REAL_DATA = Path(os.environ.get("KILN_REAL_DATA", "/work/main/target/real-data"))
# The library path kiln runs with on the device (tools/pt2e-gpu-check.sh): PyTorch, in this
# process, keeps its own cuDNN.
KILN_ENV = dict(os.environ, LD_LIBRARY_PATH=os.environ["KILN_LD"]) if os.environ.get("KILN_LD") else None
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


# ---- quantisation in PyTorch


def quantizer(affine=False):
    """XNNPACKQuantizer with its per-channel config; activations made symmetric unless `affine`."""
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    cfg = get_symmetric_quantization_config(is_per_channel=True)
    if not affine:
        act = dataclasses.replace(cfg.input_activation, qscheme=torch.per_tensor_symmetric)
        cfg = dataclasses.replace(cfg, input_activation=act, output_activation=act)
    return XNNPACKQuantizer().set_global(cfg)


def pt2e_quantise(model, example, calibration, affine=False):
    """PyTorch's PT2E flow: export, `prepare_pt2e`, one forward per calibration image, `convert_pt2e`."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    gm = torch.export.export(model.eval(), (example,)).module()
    gm = prepare_pt2e(gm, quantizer(affine))
    with torch.no_grad():
        for x in calibration:
            gm(x[None])
    return convert_pt2e(gm)


class FakeQuantNet(nn.Module):
    """Eager quantisation-aware training's form: `torch.ao.quantization.FakeQuantize` modules on
    activations (per tensor) and weights (per output channel), observers off after calibration."""

    def __init__(self):
        super().__init__()
        from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver, MovingAveragePerChannelMinMaxObserver

        def act():
            return FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
                                qscheme=torch.per_tensor_symmetric)

        def weight():
            return FakeQuantize(observer=MovingAveragePerChannelMinMaxObserver, quant_min=-127, quant_max=127, dtype=torch.qint8,
                                qscheme=torch.per_channel_symmetric, ch_axis=0)

        self.conv1, self.conv2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.fc = nn.Linear(32, 10)
        self.q_in, self.q1, self.q2, self.q_fc = act(), act(), act(), act()
        self.w1, self.w2, self.w_fc = weight(), weight(), weight()

    def forward(self, x):
        f = nn.functional
        x = f.relu(f.conv2d(self.q_in(x), self.w1(self.conv1.weight), self.conv1.bias, padding=1))
        x = f.relu(f.conv2d(self.q1(x), self.w2(self.conv2.weight), self.conv2.bias, stride=2, padding=1))
        x = self.q2(f.adaptive_avg_pool2d(x, 1).flatten(1))
        return f.linear(x, self.w_fc(self.fc.weight), self.fc.bias)


def pt2e_qat(model, example, steps):
    """PT2E's quantisation-aware form: `prepare_qat_pt2e` (fake-quant modules in the exported
    graph), a few forward passes in training mode standing in for training, then eval with the
    observers off: what kiln-torch exports is the fake-quantised model as it is."""
    from torchao.quantization.pt2e import disable_observer, move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.testing.pt2e._xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config

    gm = torch.export.export(model.train(), (example,)).module()
    gm = prepare_qat_pt2e(gm, XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_qat=True)))
    for x in steps:
        gm(x[None])
    gm = move_exported_model_to_eval(gm)
    gm.apply(disable_observer)
    return gm


def fake_quant_net(calibration):
    torch.manual_seed(0)
    m = FakeQuantNet()
    with torch.no_grad():
        for x in calibration:
            m(x[None])
    m.apply(torch.ao.quantization.disable_observer)
    return m.eval()


# ---- models


def randomise_bn(model, seed):
    """Random BatchNorm statistics and affine parameters (a fresh model's are 0/1: folding them
    would test nothing)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            m.running_mean.copy_(torch.randn(c, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(c, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(c, generator=g) + 0.5)
            m.bias.data.copy_(torch.randn(c, generator=g) * 0.1)
    return model


def torchvision_model(name, trained):
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)()
    if trained:
        (path,) = glob.glob(str(REAL_DATA / f"{name}-*.pth"))[:1] or [None]
        if path is None:
            return None, None
        model.load_state_dict(torch.load(path, map_location="cpu"))
        return model.eval(), Path(path).name
    return randomise_bn(model, 1).eval(), "random init, randomised BN"


class TinyResNet(nn.Module):
    """The CI fixture: 16/32-channel convs (the 8-bit kernel's multiples of 16), a BasicBlock with
    its skip connection, max-pool, a strided block with a downsample, average pool and a Linear."""

    def __init__(self):
        super().__init__()
        from torchvision.models.resnet import BasicBlock

        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        down = nn.Sequential(nn.Conv2d(16, 32, 1, stride=2, bias=False), nn.BatchNorm2d(32))
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2, downsample=down)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


# ---- photos


def views(path, closer=True):
    """A photo's views, normalised `[3, 224, 224]`: the 256/224 centre crop and its mirror, and
    with `closer` the 288/224 crop and its mirror."""
    import torchvision.transforms.functional as F
    from PIL import Image

    img = Image.open(path).convert("RGB")
    out = []
    for size in [256, 288] if closer else [256]:
        crop = F.center_crop(F.resize(img, [size], interpolation=F.InterpolationMode.BILINEAR), [224])
        t = F.normalize(F.to_tensor(crop), MEAN, STD)
        out += [t, torch.flip(t, [2])]
    return out


def structured(size=224):
    """Two structured images (a colour ramp and a checkerboard), normalised."""
    ramp = torch.linspace(0, 1, size)
    img1 = torch.stack([ramp[None, :].expand(size, size), ramp[:, None].expand(size, size), 1 - ramp[None, :].expand(size, size)])
    cb = ((torch.arange(size)[:, None] // 16 + torch.arange(size)[None, :] // 16) % 2).float()
    img2 = torch.stack([cb, 1 - cb, cb * 0.5])
    m, s = torch.tensor(MEAN)[:, None, None], torch.tensor(STD)[:, None, None]
    return [(img1 - m) / s, (img2 - m) / s]


def photo_split():
    photos = sorted(p for p in (REAL_DATA / "photos").iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not photos:
        sys.exit(f"no photos under {REAL_DATA / 'photos'} (tools/fetch_real_data.py)")
    calib = [v for p in photos[0::2] for v in views(p, closer=False)] + structured()
    judged = [v for p in photos[1::2] for v in views(p)]
    return calib, torch.stack(judged), [p.name for p in photos[1::2]]


# ---- Kiln


def graph_counts(path):
    """(fake-quantisers, lone quantize/dequantize nodes, weights on an 8-bit grid) of a graph file."""
    g = json.loads(read_metadata(path)["kiln.graph"])
    fq = sum(1 for n in g["nodes"] if "Quant" in n["op"] and "FakeQuantize" in n["op"]["Quant"])
    lone = sum(1 for n in g["nodes"] if "Quant" in n["op"] and "FakeQuantize" not in n["op"]["Quant"])
    grid = sum(1 for n in g["nodes"] if "Weight" in n["op"] and n["op"]["Weight"].get("quant"))
    return fq, lone, grid


def read_metadata(path):
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])["__metadata__"]


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def kiln_compare(kiln, graph, ref, out_dir, name, engine=False):
    """Kiln's outputs on the reference's inputs: the CPU simulation of the INT8 engine, or with
    `engine` the INT8 engine itself (built on the GPU from the graph's Q/DQ nodes)."""
    saved = out_dir / f"{name}.{'engine' if engine else 'simulation'}_outputs.safetensors"
    cmd = [str(kiln), "compare", str(graph), "--int8", "--reference", str(ref), "--save-outputs", str(saved)]
    if not engine:
        cmd.insert(3, "--cpu")
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=KILN_ENV)
    if not saved.exists():
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    tensors, _ = kg.decode_safetensors(saved.read_bytes())
    header = next((line for line in p.stdout.splitlines() if " against " in line), "")
    return tensors["output.output"], header.strip(), time.time() - t


def kiln_build(kiln, graph, out_dir, name):
    """`kiln build <graph> --int8`: its first error line (no GPU here: the build stops where it needs one)."""
    p = subprocess.run([str(kiln), "build", str(graph), "--int8", "-o", str(out_dir / f"{name}.int8.kiln")], capture_output=True, text=True,
                       env=KILN_ENV)
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    return p.returncode, lines


# ---- the checks


def check(kiln, out_dir, name, model, calib, judged, what, engine=False):
    """PT2E-quantises `model` (or takes a fake-quant model as it is), exports it, runs Kiln's CPU
    simulation on `judged` and returns the table row."""
    example = judged[:1]
    with torch.no_grad():
        fp32 = torch.cat([model(x[None]) for x in judged]) if not isinstance(model, FakeQuantNet) else None
    t = time.time()
    q = model if isinstance(model, FakeQuantNet) else pt2e_quantise(model, example, calib, affine="affine" in name)
    t_quant = time.time() - t
    with torch.no_grad():
        ref = torch.cat([q(x[None]) for x in judged]).numpy()
        # The floor: PyTorch against itself with its convs on another algorithm (im2col and GEMM
        # instead of oneDNN), so summed in another order. A value that lands near a rounding
        # boundary of the next quantiser goes to the neighbouring code, and the difference grows
        # downstream; no executor that sums in its own order can be closer than this.
        with torch.backends.mkldnn.flags(enabled=False):
            alt = torch.cat([q(x[None]) for x in judged]).numpy()
    graph = out_dir / f"{name}.kiln.safetensors"
    result = kiln_torch.export(q, (example,), graph, input_names=["input"], output_names=["output"], model_name=name)
    refs = out_dir / f"{name}.reference.safetensors"
    refs.write_bytes(kg.encode_reference({"input": judged.numpy()}, {"output": ref}, {"model": name}))
    out, header, t_kiln = kiln_compare(kiln, graph, refs, out_dir, name)
    fq, lone, grid = graph_counts(graph)
    rc, build = kiln_build(kiln, graph, out_dir, name)
    eng = {}
    if engine:
        e, e_header, t_engine = kiln_compare(kiln, graph, refs, out_dir, name, engine=True)
        eng = {"engine_rel_l2": rel_l2(e, ref), "engine_max_abs": float(np.abs(e - ref).max()), "engine_top1": int((e.argmax(1) == ref.argmax(1)).sum()),
               "engine_vs_sim_rel_l2": rel_l2(e, out), "engine_vs_sim_top1": int((e.argmax(1) == out.argmax(1)).sum()),
               "engine_header": e_header, "engine_seconds": round(t_engine, 1)}
    row = {
        "model": name,
        "what": what,
        "images": len(judged),
        "rel_l2": rel_l2(out, ref),
        "max_abs": float(np.abs(out - ref).max()),
        "floor_rel_l2": rel_l2(alt, ref),
        "floor_max_abs": float(np.abs(alt - ref).max()),
        "floor_top1": int((alt.argmax(1) == ref.argmax(1)).sum()),
        "ref_max_abs": float(np.abs(ref).max()),
        "top1": int((out.argmax(1) == ref.argmax(1)).sum()),
        "q_vs_fp32_top1": int((ref.argmax(1) == fp32.numpy().argmax(1)).sum()) if fp32 is not None else None,
        "fake_quantizers": fq,
        "lone_q_dq": lone,
        "weights_on_grid": grid,
        "header": header,
        "build_rc": rc,
        "build": build[-1] if build else "",
        "seconds": {"quantise": round(t_quant, 1), "kiln_cpu": round(t_kiln, 1)},
        "graph": str(graph),
        "reference": str(refs),
        **eng,
    }
    assert not result.metadata.get("missing"), result.metadata
    return row


def write_fixtures(out: Path):
    """The CI fixtures (tests/pt2e.rs): a PT2E-quantised tiny ResNet, the same prepared for QAT
    (`prepare_qat_pt2e`) and the eager fake-quant network, each with 4 random inputs and PyTorch's
    quantised outputs on them."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    # 28x28: the global average pool reads 7x7. Over a power-of-two window the mean of values on a
    # grid lands exactly on rounding ties, whose side depends on the order of the sum (PyTorch's
    # `mean` is a vectorised cascade sum), so the next quantiser would differ by whole codes.
    calib = [torch.randn(3, 28, 28, generator=g) for _ in range(8)]
    x = torch.randn(4, 3, 28, 28, generator=g)
    torch.manual_seed(0)
    tiny = randomise_bn(TinyResNet(), 2).eval()
    models = {"tiny_resnet_pt2e": pt2e_quantise(tiny, x[:1], calib), "fake_quant_net": fake_quant_net(calib)}
    torch.manual_seed(0)
    models["tiny_resnet_qat_pt2e"] = pt2e_qat(randomise_bn(TinyResNet(), 2), x[:1], calib[:4])
    for name, q in models.items():
        with torch.no_grad():
            ref = torch.cat([q(xi[None]) for xi in x]).numpy()
        kiln_torch.export(q, (x[:1],), out / f"{name}.kiln.safetensors", input_names=["input"], output_names=["output"],
                          model_name=name, metadata={"made_by": "tools/pt2e_check.py --fixtures"})
        (out / f"{name}.reference.safetensors").write_bytes(
            kg.encode_reference({"input": x.numpy()}, {"output": ref}, {"model": name, "torch": torch.__version__}))
        print(f"wrote {out / name}.{{kiln,reference}}.safetensors ({(out / f'{name}.kiln.safetensors').stat().st_size} bytes), "
              f"graph {graph_counts(out / f'{name}.kiln.safetensors')}")


def table(rows):
    lines = [
        "| model | weights | images | Kiln rel L2 | Kiln max-abs (max \\|logit\\|) | Kiln top-1 = PyTorch | floor rel L2 | floor max-abs "
        "| floor top-1 | PyTorch quantised vs FP32 top-1 | fake-quantisers / lone Q, DQ / weights on grid |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q32 = f"{r['q_vs_fp32_top1']}/{r['images']}" if r["q_vs_fp32_top1"] is not None else "—"
        lines.append(
            f"| {r['model']} | {r['what']} | {r['images']} | {r['rel_l2']:.2e} | {r['max_abs']:.2e} ({r['ref_max_abs']:.1f}) "
            f"| {r['top1']}/{r['images']} | {r['floor_rel_l2']:.2e} | {r['floor_max_abs']:.2e} | {r['floor_top1']}/{r['images']} "
            f"| {q32} | {r['fake_quantizers']} / {r['lone_q_dq']} / {r['weights_on_grid']} |"
        )
    engines = [r for r in rows if "engine_rel_l2" in r]
    if engines:
        lines += ["", "| model | INT8 engine rel L2 against PyTorch | max-abs | top-1 = PyTorch | engine against the simulation: rel L2 | top-1 |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['engine_rel_l2']:.2e} | {r['engine_max_abs']:.2e} | {r['engine_top1']}/{r['images']} "
                  f"| {r['engine_vs_sim_rel_l2']:.2e} | {r['engine_vs_sim_top1']}/{r['images']} |" for r in engines]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default=str(ROOT / "target/release/kiln"))
    ap.add_argument("--out", default=str(ROOT / "target/pt2e"))
    ap.add_argument("--models", default="resnet18,mobilenet_v2,mobilenet_v2:trained,fake_quant_net")
    ap.add_argument("--affine", action="store_true", help="also the trained MobileNetV2 with XNNPACK's affine activations")
    ap.add_argument("--fixtures", help="write the CI fixtures to this folder and stop")
    ap.add_argument("--engine", action="store_true", help="also build and run the INT8 engines (needs a GPU)")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if a.fixtures:
        write_fixtures(Path(a.fixtures))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    calib, judged, names = photo_split()
    print(f"calibration: {len(calib)} images; judged: {len(judged)} views of {', '.join(names)}")
    rows = []
    models = a.models.split(",") + (["mobilenet_v2:trained:affine"] if a.affine else [])
    for spec in models:
        parts = spec.split(":")
        if parts[0] == "fake_quant_net":
            small = [torch.nn.functional.interpolate(x[None], size=32, mode="area")[0] for x in calib]
            judged_small = torch.nn.functional.interpolate(judged, size=32, mode="area")
            model, what = fake_quant_net(small), "FakeQuantize modules (eager QAT form)"
            row = check(a.kiln, out, "fake_quant_net", model, small, judged_small, what, a.engine)
        else:
            trained = "trained" in parts
            model, what = torchvision_model(parts[0], trained)
            if model is None:
                print(f"{spec}: no checkpoint under {REAL_DATA}; skipped")
                continue
            name = "_".join(parts)
            row = check(a.kiln, out, name, model, calib, judged, what + (", affine activations" if "affine" in parts else ""), a.engine)
        rows.append(row)
        keys = ("model", "rel_l2", "max_abs", "top1", "floor_rel_l2", "floor_top1", "q_vs_fp32_top1", "header", "build", "seconds")
        print(json.dumps({k: row[k] for k in keys + tuple(k for k in row if k.startswith("engine"))}), flush=True)
    print()
    print(f"torch {torch.__version__}, torchao {__import__('torchao').__version__}")
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
