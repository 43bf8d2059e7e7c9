#!/usr/bin/env python3
"""FP32 references with PyTorch's own FP16 beside them, for tests/gpu_fidelity.rs (issue 28, item 5).

For each classifier of the zoo (or --models): torchvision's own module with its random init and
BatchNorm statistics measured through its drawn affine parameters (export_reference.load_weights
with `consistent_batchnorm`: every BatchNorm normalises its input, as after training), the seeded input
at the model's default size (or --size HxW), run on CUDA in FP32 with TF32 off, then the same
module in FP16 (`.half()`, the input cast to f16, as PyTorch's FP16 peers run). Writes to --out:
- <model>.reference.safetensors: `input`, `output.logits` (FP32), `fp16.logits` (PyTorch's FP16
  output as f32); the metadata holds `fp16_rel_l2.logits`, PyTorch FP16's rel L2 against FP32;
- <model>.weights.safetensors: the state_dict Kiln loads.

    python3 tools/export_fp16_reference.py --out $KILN_REFERENCE_DIR/fidelity [--models a,b]
"""

import argparse
import copy
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import export_reference as er  # noqa: E402
import seeded  # noqa: E402


def rel_l2(got, want):
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def export(model, size, seed, out, device="cuda"):
    # BatchNorm statistics measured through the drawn affine parameters (see randomise_batchnorm).
    net = er.load_weights(model, er.build(model), "torchvision", seed, consistent_batchnorm=True).eval().float()
    h, w = size or (er.default_size(model),) * 2
    x = torch.from_numpy(seeded.weight(f"input.{seed}", [1, 3, h, w]))
    net = net.to(device)
    fp32 = er.run_model(net, model, x.to(device))["logits"].float().cpu()
    half = copy.deepcopy(net).half()
    fp16 = er.run_model(half, model, x.to(device).half())["logits"].float().cpu()
    rel = rel_l2(fp16, fp32)
    wpath = os.path.join(out, f"{model}.weights.safetensors")
    # As export_reference.py writes it (integer buffers such as Swin's relative_position_index too).
    save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}, wpath)
    meta = {"model": model, "weights": "torchvision, consistent BatchNorm statistics", "seed": str(seed), "input_shape": f"1x3x{h}x{w}", "fp16_rel_l2.logits": f"{rel:.6e}"}
    tensors = {"input": x, "output.logits": fp32, "fp16.logits": fp16}
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, f"{model}.reference.safetensors"), metadata=meta)
    print(f"{model}: input {h}x{w}, PyTorch FP16 rel L2 against FP32 {rel:.3e}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--models", default="", help="comma-separated; default: every bundled classifier")
    p.add_argument("--size", type=er.parse_size, help="HxW (default: each model's input size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda (the reference), or cpu for a smoke run")
    p.add_argument("--kiln", help="the kiln binary that lists the bundled models (as export_reference.py)")
    args = p.parse_args()
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_grad_enabled(False)
    os.makedirs(args.out, exist_ok=True)
    er.load_models(args.kiln)
    models = [m for m in args.models.split(",") if m] or [m for m in er.MODELS if er.family(m) == "classifier"]
    failed = []
    for m in models:
        try:
            export(m, args.size, args.seed, args.out, args.device)
        except Exception as e:  # one model's failure must not hide the others' references
            print(f"EXPORT FAILED: {m}: {e}")
            failed.append(m)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
