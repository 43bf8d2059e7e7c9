#!/usr/bin/env python3
"""What the libraries offer for 8-bit convolution on this GPU, measured on ResNet-50's conv shapes
(issue 9's survey, docs/QUANT.md "Library survey").

For each shape, at batch N in NHWC, it times the fastest working configuration of:
  cudnn-graph-{fp8,int8,fp16}  cuDNN's graph API (cudnn-frontend's Python binding): conv, then the
                               epilogue Kiln's 8-bit kernel fuses (per-channel scale, bias, the 8-bit
                               residual times its scale, ReLU, requantisation to 8-bit codes). Every
                               engine the heuristics offer is built and timed.
  cudnn-legacy-int8            cudnnConvolutionForward, INT8 NHWC in, INT8 out (INT8_CONFIG: one
                               scalar alpha, no per-channel scale), and INT8 in, FP32 out (INT8_EXT).
  cublaslt-*                   1x1 stride-1 convs as GEMMs through PyTorch: FP8 with FP8 output
                               (per-tensor scales), INT8 with INT32 output, FP16.
  torch-fp16                   F.conv2d, FP16 channels-last (cuDNN), the FP16 baseline.
and checks each cuDNN graph result against the same arithmetic in FP32 PyTorch (rel L2 of the
dequantised codes). Unsupported configurations are reported with cuDNN's reason, not skipped.

Needs PyTorch with CUDA and cudnn-frontend (`pip install nvidia-cudnn-frontend`; no GPU wheel
of it ships with PyTorch). Kiln's own kernel on the same layers: `kiln profile resnet50
--precision int8 --batch N --json F` (the layer paths match the names below).
"""
import argparse
import ctypes
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

# name, in channels, out channels, input size, kernel, stride, residual (ResNet-50 at 224x224).
SHAPES = [
    ("layer1.0.conv1", 64, 64, 56, 1, 1, False),
    ("layer1.0.conv2", 64, 64, 56, 3, 1, False),
    ("layer1.0.conv3", 64, 256, 56, 1, 1, True),
    ("layer1.1.conv1", 256, 64, 56, 1, 1, False),
    ("layer2.0.conv2", 128, 128, 56, 3, 2, False),
    ("layer2.1.conv2", 128, 128, 28, 3, 1, False),
    ("layer2.1.conv3", 128, 512, 28, 1, 1, True),
    ("layer3.1.conv1", 1024, 256, 14, 1, 1, False),
    ("layer3.1.conv2", 256, 256, 14, 3, 1, False),
    ("layer3.1.conv3", 256, 1024, 14, 1, 1, True),
    ("layer4.1.conv2", 512, 512, 7, 3, 1, False),
    ("layer4.1.conv3", 512, 2048, 7, 1, 1, True),
]
MAX_PLANS = 12  # engines built and timed per cuDNN graph (runtime-fusion engines compile on build)


def time_ms(fn, iters, set_stream=None):
    """Mean milliseconds of fn() on the GPU, on a side stream: replayed from a CUDA graph when it
    captures (no host overhead in the figure), else launched back to back. `set_stream` points a
    library handle at that stream (and back at the default one afterwards)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    if set_stream:
        set_stream(s.cuda_stream)
    try:
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
            s.synchronize()
            run = fn
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    fn()
                g.replay()
                run = g.replay
            except Exception:
                torch.cuda.synchronize()
            s.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s)
            for _ in range(iters):
                run()
            end.record(s)
            end.synchronize()
    finally:
        if set_stream:
            set_stream(torch.cuda.current_stream().cuda_stream)
    return start.elapsed_time(end) / iters


def channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def nhwc_stride(dims):
    n, c, h, w = dims
    return [c * h * w, 1, w * c, c]


class Problem:
    """One conv's tensors: 8-bit codes (as the int8 or fp8 engine stores them) and their scales."""

    def __init__(self, n, c, k, hw, r, stride, residual, gen):
        self.n, self.c, self.k, self.hw, self.r, self.stride, self.residual = n, c, k, hw, r, stride, residual
        self.pad = r // 2
        self.p = (hw + 2 * self.pad - r) // stride + 1
        dev = "cuda"
        self.xf = torch.randn(n, c, hw, hw, generator=gen, device=dev)
        self.wf = torch.randn(k, c, r, r, generator=gen, device=dev)
        fan = c * r * r
        self.alpha = (0.5 + torch.rand(k, generator=gen, device=dev)) / math.sqrt(fan)
        self.bias = 0.1 * torch.randn(k, generator=gen, device=dev)
        self.zf = torch.randn(n, k, self.p, self.p, generator=gen, device=dev)

    def flops(self):
        return 2.0 * self.n * self.p * self.p * self.k * self.c * self.r * self.r

    def codes(self, kind):
        """x, w, z as codes of `kind` (channels-last), the factor that turns codes back into the
        unit-scale values above, and the output's 1/scale."""
        if kind == "int8":
            q = lambda t, s: channels_last(torch.clamp(torch.round(t * s), -127, 127).to(torch.int8))
            sx, sw, sz = 32.0, 64.0, 32.0
            return q(self.xf, sx), q(self.wf, sw), q(self.zf, sz), sx, sw, sz, 127.0 / 6.0
        if kind == "fp8":
            q = lambda t, s: channels_last((t * s).to(torch.float8_e4m3fn))
            sx, sw, sz = 64.0, 64.0, 64.0
            return q(self.xf, sx), q(self.wf, sw), q(self.zf, sz), sx, sw, sz, 448.0 / 8.0
        q = lambda t, s: channels_last((t * s).half())
        return q(self.xf, 1.0), q(self.wf, 1.0), q(self.zf, 1.0), 1.0, 1.0, 1.0, 1.0

    def reference(self, x, w, z, sx, sw, sz, inv_y, kind):
        """The epilogue's result in FP32, before rounding to the output's codes."""
        acc = F.conv2d(x.float(), w.float(), stride=self.stride, padding=self.pad)
        v = acc * (self.alpha / (sx * sw)).view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)
        if self.residual:
            v = v + z.float() / sz
        return torch.relu(v) * inv_y


def cudnn_graph(cudnn, handle, prob, kind, iters):
    """The fused conv as one cuDNN graph; returns (best ms, engine name, plans timed, rel L2)."""
    dt = {"int8": cudnn.data_type.INT8, "fp8": cudnn.data_type.FP8_E4M3, "fp16": cudnn.data_type.HALF}[kind]
    conv_compute = cudnn.data_type.INT32 if kind == "int8" else cudnn.data_type.FLOAT
    x, w, z, sx, sw, sz, inv_y = prob.codes(kind)
    n, k, p = prob.n, prob.k, prob.p
    alpha = (prob.alpha / (sx * sw)).view(1, k, 1, 1).contiguous()
    bias = prob.bias.view(1, k, 1, 1).contiguous()
    zscale = torch.full((1, 1, 1, 1), 1.0 / sz, device="cuda")
    iscale = torch.full((1, 1, 1, 1), inv_y, device="cuda")
    g = cudnn.pygraph(intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    X = g.tensor(name="x", dim=list(x.shape), stride=list(x.stride()), data_type=dt)
    W = g.tensor(name="w", dim=list(w.shape), stride=list(w.stride()), data_type=dt)
    A = g.tensor(name="alpha", dim=[1, k, 1, 1], stride=[k, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
    B = g.tensor(name="bias", dim=[1, k, 1, 1], stride=[k, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
    IS = g.tensor(name="inv_y", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
    pad = [prob.pad, prob.pad]
    try:
        acc = g.conv_fprop(image=X, weight=W, padding=pad, stride=[prob.stride] * 2, dilation=[1, 1], compute_data_type=conv_compute, name="conv")
    except TypeError:
        acc = g.conv_fprop(image=X, weight=W, pre_padding=pad, post_padding=pad, stride=[prob.stride] * 2, dilation=[1, 1], compute_data_type=conv_compute, name="conv")
    acc.set_data_type(cudnn.data_type.FLOAT)
    v = g.mul(a=acc, b=A, compute_data_type=cudnn.data_type.FLOAT, name="scale")
    v = g.add(a=v, b=B, compute_data_type=cudnn.data_type.FLOAT, name="bias")
    pack = {X: x, W: w, A: alpha, B: bias, IS: iscale}
    if prob.residual:
        Z = g.tensor(name="z", dim=list(z.shape), stride=list(z.stride()), data_type=dt)
        ZS = g.tensor(name="z_scale", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
        zv = g.mul(a=Z, b=ZS, compute_data_type=cudnn.data_type.FLOAT, name="residual_scale")
        v = g.add(a=v, b=zv, compute_data_type=cudnn.data_type.FLOAT, name="residual")
        pack[Z], pack[ZS] = z, zscale
    v = g.relu(input=v, compute_data_type=cudnn.data_type.FLOAT, name="relu")
    Y = g.mul(a=v, b=IS, compute_data_type=cudnn.data_type.FLOAT, name="requantise")
    Y.set_output(True)
    Y.set_data_type(dt)
    Y.set_dim([n, k, p, p])
    Y.set_stride(nhwc_stride([n, k, p, p]))
    y = channels_last(torch.empty(n, k, p, p, device="cuda", dtype=x.dtype))
    pack[Y] = y
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    count = g.get_execution_plan_count()
    best, best_name, timed, errors = None, None, 0, []
    for i in range(min(count, MAX_PLANS)):
        try:
            g.build_plan_at_index(i)
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), device="cuda", dtype=torch.uint8)
            name = g.get_plan_name_at_index(i)
            ms = time_ms(lambda: g.execute_plan_at_index(pack, ws, i, handle), iters, lambda st: cudnn.set_stream(handle=handle, stream=st))
            timed += 1
            if best is None or ms < best:
                best, best_name = ms, name
                g.execute_plan_at_index(pack, ws, i, handle)
                torch.cuda.synchronize()
                ref = prob.reference(x, w, z, sx, sw, sz, inv_y, kind)
                if kind == "int8":
                    ref = torch.clamp(torch.round(ref), -128, 127)
                rel = (torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref)).item()
        except Exception as e:  # an engine that does not build or run here: keep the reason
            errors.append(str(e).splitlines()[0][:160] if str(e) else type(e).__name__)
    if best is None:
        raise RuntimeError(f"{count} plans, none ran: {errors[:2]}")
    return best, best_name, timed, rel


class LegacyCudnn:
    """cudnnConvolutionForward through ctypes: the legacy INT8 configurations."""

    NHWC, INT8, INT32, FLOAT, CROSS_CORRELATION = 1, 3, 4, 0, 1

    def __init__(self):
        self.lib = ctypes.CDLL("libcudnn.so.9")
        self.handle = ctypes.c_void_p()
        self.check(self.lib.cudnnCreate(ctypes.byref(self.handle)), "cudnnCreate")
        self.check(self.lib.cudnnSetStream(self.handle, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cudnnSetStream")

    def set_stream(self, stream):
        self.check(self.lib.cudnnSetStream(self.handle, ctypes.c_void_p(stream)), "cudnnSetStream")

    def check(self, status, what):
        if status != 0:
            self.lib.cudnnGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.cudnnGetErrorString(status).decode()}")

    def desc(self, create, set_fn, *args):
        d = ctypes.c_void_p()
        self.check(getattr(self.lib, create)(ctypes.byref(d)), create)
        self.check(getattr(self.lib, set_fn)(d, *[ctypes.c_int(a) for a in args]), set_fn)
        return d

    def conv(self, prob, out_float, iters):
        x, w, _, _, _, _, _ = prob.codes("int8")
        n, c, k, hw, p = prob.n, prob.c, prob.k, prob.hw, prob.p
        xd = self.desc("cudnnCreateTensorDescriptor", "cudnnSetTensor4dDescriptor", self.NHWC, self.INT8, n, c, hw, hw)
        wd = self.desc("cudnnCreateFilterDescriptor", "cudnnSetFilter4dDescriptor", self.INT8, self.NHWC, k, c, prob.r, prob.r)
        ydt = self.FLOAT if out_float else self.INT8
        yd = self.desc("cudnnCreateTensorDescriptor", "cudnnSetTensor4dDescriptor", self.NHWC, ydt, n, k, p, p)
        cd = self.desc("cudnnCreateConvolutionDescriptor", "cudnnSetConvolution2dDescriptor", prob.pad, prob.pad, prob.stride, prob.stride, 1, 1, self.CROSS_CORRELATION, self.INT32)
        y = channels_last(torch.empty(n, k, p, p, device="cuda", dtype=torch.float32 if out_float else torch.int8))
        alpha, beta = ctypes.c_float(1.0 / 64), ctypes.c_float(0.0)
        best, errors = None, []
        for algo in (0, 1):  # IMPLICIT_GEMM, IMPLICIT_PRECOMP_GEMM
            try:
                size = ctypes.c_size_t()
                self.check(self.lib.cudnnGetConvolutionForwardWorkspaceSize(self.handle, xd, wd, cd, yd, algo, ctypes.byref(size)), "workspace size")
                ws = torch.empty(max(1, size.value), device="cuda", dtype=torch.uint8)

                def run():
                    self.check(
                        self.lib.cudnnConvolutionForward(
                            self.handle, ctypes.byref(alpha), xd, ctypes.c_void_p(x.data_ptr()), wd, ctypes.c_void_p(w.data_ptr()), cd, algo,
                            ctypes.c_void_p(ws.data_ptr()), ctypes.c_size_t(size.value), ctypes.byref(beta), yd, ctypes.c_void_p(y.data_ptr())),
                        "cudnnConvolutionForward")

                ms = time_ms(run, iters, self.set_stream)
                best = ms if best is None else min(best, ms)
            except Exception as e:
                errors.append(f"algo {algo}: {e}")
        if best is None:
            raise RuntimeError("; ".join(errors))
        return best


def gemm_rows(prob, kind, iters):
    """A 1x1 stride-1 conv as the GEMM [N·H·W, C] x [C, K] through PyTorch's cuBLASLt paths."""
    m, kk, nn = prob.n * prob.hw * prob.hw, prob.c, prob.k
    a32 = torch.randn(m, kk, device="cuda")
    b32 = torch.randn(nn, kk, device="cuda")
    if kind == "fp8":
        a, b = a32.to(torch.float8_e4m3fn), b32.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device="cuda")
        return time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.float8_e4m3fn, scale_result=one), iters)
    if kind == "int8":
        a, b = a32.clamp(-3, 3).mul(40).to(torch.int8), b32.clamp(-3, 3).mul(40).to(torch.int8).t()
        return time_ms(lambda: torch._int_mm(a, b), iters)
    a, b = a32.half(), b32.half().t()
    return time_ms(lambda: torch.mm(a, b), iters)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[256])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--only", help="comma-separated layer names")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    try:
        import cudnn
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        print(f"cudnn-frontend {cudnn.__version__}, backend {cudnn.backend_version()}")
    except Exception as e:
        cudnn, handle = None, None
        print(f"cudnn-frontend unavailable: {e}")
    try:
        legacy = LegacyCudnn()
    except Exception as e:
        legacy = None
        print(f"legacy cuDNN unavailable: {e}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = [s for s in SHAPES if not args.only or s[0] in args.only.split(",")]
    for n in args.batch:
        for name, c, k, hw, r, stride, residual in shapes:
            prob = Problem(n, c, k, hw, r, stride, residual, gen)
            row = {"layer": name, "batch": n, "c": c, "k": k, "hw": hw, "r": r, "stride": stride, "residual": residual, "gflop": prob.flops() / 1e9}
            t0 = time.time()
            x16, w16 = prob.codes("fp16")[:2]
            row["torch-fp16"] = time_ms(lambda: F.conv2d(x16, w16, stride=stride, padding=prob.pad), args.iters)
            for kind in ("fp8", "int8", "fp16"):
                if cudnn is None:
                    break
                try:
                    ms, engine, timed, rel = cudnn_graph(cudnn, handle, prob, kind, args.iters)
                    row[f"cudnn-graph-{kind}"] = ms
                    row[f"cudnn-graph-{kind}.engine"] = f"{engine} (best of {timed})"
                    row[f"cudnn-graph-{kind}.rel_l2"] = rel
                except Exception as e:
                    row[f"cudnn-graph-{kind}.error"] = str(e).replace("\n", " ")[:300]
            if legacy is not None:
                for out_float, key in ((False, "cudnn-legacy-int8"), (True, "cudnn-legacy-int8-f32out")):
                    try:
                        row[key] = legacy.conv(prob, out_float, args.iters)
                    except Exception as e:
                        row[f"{key}.error"] = str(e)[:300]
            if r == 1 and stride == 1:
                for kind in ("fp8", "int8", "fp16"):
                    try:
                        row[f"cublaslt-{kind}"] = gemm_rows(prob, kind, args.iters)
                    except Exception as e:
                        row[f"cublaslt-{kind}.error"] = str(e).splitlines()[0][:300]
            row["survey_s"] = round(time.time() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del prob
            torch.cuda.empty_cache()
    keys = ["torch-fp16", "cudnn-graph-fp16", "cudnn-graph-fp8", "cudnn-graph-int8", "cudnn-legacy-int8", "cudnn-legacy-int8-f32out", "cublaslt-fp16", "cublaslt-fp8", "cublaslt-int8"]
    print("\nms per layer (— : unsupported or not applicable)")
    print("| layer | batch | GFLOP | " + " | ".join(keys) + " |")
    for row in rows:
        cells = [f"{row[k]:.3f}" if k in row else "—" for k in keys]
        print(f"| {row['layer']} | {row['batch']} | {row['gflop']:.1f} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
