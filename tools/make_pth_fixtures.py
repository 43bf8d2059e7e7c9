#!/usr/bin/env python3
"""Writes the small PyTorch checkpoints that test Kiln's checkpoint reader (src/pth/), in both of
torch.save's formats, and the values they hold.

Writes tests/fixtures/pth/ (a few KB in all):
  tiny.zip.pth, tiny.legacy.pth     a Conv-BN-Linear model's state_dict (f32, int64
                                    num_batches_tracked), zip and legacy format
  mixed.zip.pt, mixed.legacy.pt     {"state_dict": ..., "epoch": 3}: f16 and bf16 tensors, a
                                    transposed view and an offset slice sharing one storage,
                                    an nn.Parameter, an empty tensor, a scalar
  model.proto4.pth                  {"model": state_dict, "step": 7} with pickle protocol 4
                                    (FRAME, MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL)
  args.zip.pth                      {"state_dict": ..., "args": argparse.Namespace(...)}: the
                                    reader must refuse `argparse.Namespace`
  expected.json                     per file and key: shape and float32 values (row-major)

    /path/to/venv-with-torch/bin/python tools/make_pth_fixtures.py
"""

import argparse
import json
import os
from collections import OrderedDict

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "pth")


def tiny():
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(conv=nn.Conv2d(3, 4, 3), bn=nn.BatchNorm2d(4), fc=nn.Linear(4, 2)))
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    model.bn.num_batches_tracked += 5
    return model.state_dict()


def mixed():
    torch.manual_seed(1)
    base = torch.randn(3, 5)
    return OrderedDict(
        [
            ("half", torch.randn(2, 3).half()),
            ("bf16", torch.randn(4).bfloat16()),
            ("base", base),
            ("base_t", base.t()),  # strides (1, 5), the same storage
            ("base_rows", base[1:]),  # storage offset 5
            ("param", nn.Parameter(torch.randn(2, 2))),
            ("empty", torch.zeros(0, 3)),
            ("scalar", torch.tensor(2.5)),
        ]
    )


def expected(sd):
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."), "values": v.detach().float().flatten().tolist()}
        for k, v in sd.items()
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    t, m = tiny(), mixed()
    files = {
        "tiny.zip.pth": (t, t, {}),
        "tiny.legacy.pth": (t, t, {"_use_new_zipfile_serialization": False}),
        "mixed.zip.pt": ({"state_dict": m, "epoch": 3}, m, {}),
        "mixed.legacy.pt": ({"state_dict": m, "epoch": 3}, m, {"_use_new_zipfile_serialization": False}),
        "model.proto4.pth": ({"model": t, "step": 7}, t, {"pickle_protocol": 4}),
        "args.zip.pth": ({"state_dict": t, "args": argparse.Namespace(lr=0.1)}, None, {}),
    }
    out = {}
    for name, (obj, sd, kwargs) in files.items():
        path = os.path.join(OUT, name)
        torch.save(obj, path, **kwargs)
        if sd is not None:
            out[name] = expected(sd)
        print(f"{name}: {os.path.getsize(path)} bytes")
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
