"""A 3-D convolution whose kernel is 1 along a dim (timm's LambdaLayer) as one grouped 2-D
convolution (`ops._conv3d_of_planes`), without torch: the converter is called as the exporter
calls it, and the Kiln graph it builds is run by a NumPy model of the Kiln ops at batch 2 and 3
against a direct NumPy 3-D convolution."""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kiln_torch import ops  # noqa: E402
from kiln_torch.convert import Builder  # noqa: E402
from kiln_torch.graph import Act, Const  # noqa: E402
from kiln_torch.ops import Unsupported  # noqa: E402


def conv2d(x, w, b, stride, padding, dilation, groups):
    """Kiln's `Conv` (not transposed) in NumPy: `[N, C, H, W]` by `[O, C/g, kh, kw]`."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    x = np.pad(x, [(0, 0), (0, 0), (padding[0], padding[0]), (padding[1], padding[1])])
    oh = (x.shape[2] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (x.shape[3] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    y = np.zeros((n, o, oh, ow), np.float64)
    og = o // groups
    for g in range(groups):
        xs = x[:, g * cg:(g + 1) * cg]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dilation[0]: i * dilation[0] + stride[0] * (oh - 1) + 1: stride[0],
                           j * dilation[1]: j * dilation[1] + stride[1] * (ow - 1) + 1: stride[1]]
                y[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, w[g * og:(g + 1) * og, :, i, j])
    if b is not None:
        y += b[None, :, None, None]
    return y


def conv3d(x, w, b, padding):
    """PyTorch's 3-D convolution (stride 1, groups 1) in NumPy."""
    x = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    kd, kh, kw = w.shape[2:]
    out = [x.shape[2 + i] - k + 1 for i, k in enumerate((kd, kh, kw))]
    y = np.zeros((x.shape[0], w.shape[0], *out), np.float64)
    for i in range(kd):
        for j in range(kh):
            for k in range(kw):
                y += np.einsum("ncdhw,oc->nodhw", x[:, :, i:i + out[0], j:j + out[1], k:k + out[2]], w[:, :, i, j, k])
    return y + b[None, :, None, None, None]


def run(graph, weights, x):
    values = []
    for node in graph["nodes"]:
        (family, body), = node["op"].items()
        xs = [values[i] for i in node["inputs"]]
        if family == "Input":
            v = x
        elif family == "Weight":
            v = weights[body["name"]]
        elif family == "Conv":
            bias = xs[2] if body["bias"] else None
            v = conv2d(xs[0], xs[1], bias, body["stride"], body["padding"], body["dilation"], body["groups"])
        else:
            (kind, a), = body.items()
            if kind == "Reshape":
                v = xs[0].reshape([xs[0].shape[0]] + a["dims"])
            elif kind == "Flatten":
                v = xs[0].reshape(list(xs[0].shape[: a["start"]]) + [-1])
            elif kind == "Permute":
                v = xs[0].transpose(a["dims"])
            else:
                raise AssertionError(f"the model has no {kind}")
        values.append(np.asarray(v, np.float32))
    return {name: values[i] for name, i in graph["outputs"]}


W = (np.arange(4 * 2 * 3 * 3, dtype=np.float32).reshape(4, 2, 3, 3, 1) % 7 - 3) / 10
B = np.array([0.1, -0.2, 0.3, 0.0], np.float32)


def lambda_conv(batch=2, dims=(2, 5, 4, 3)):
    """`Conv3d(2, 4, (3, 3, 1), padding=(1, 1, 0))` on `[B, 2, 5, 4, 3]`, as the exporter calls it."""
    b = Builder()
    b.batch = batch
    shape = (batch,) + dims
    x = Act(b.graph.input("x", shape), shape)
    b.begin("aten.convolution.default", "convolution", "attn.conv_lambda", True, (batch, 4) + dims[1:])
    y = ops.TABLE["aten.convolution.default"](b, {
        "input": x, "weight": Const("attn.conv_lambda.weight", W), "bias": Const("attn.conv_lambda.bias", B),
        "stride": [1, 1, 1], "padding": [1, 1, 0], "dilation": [1, 1, 1], "transposed": False,
        "output_padding": [0, 0, 0], "groups": 1})
    b.graph.mark_output("output", b.unlift(y).id)
    return b


class Conv3d(unittest.TestCase):
    def test_a_3d_convolution_of_kernel_1_along_a_dim_is_a_grouped_2d_one(self):
        for batch in (1, 2):
            b = lambda_conv(batch)
            graph = b.graph.to_json()
            convs = [n for n in graph["nodes"] if "Conv" in n["op"]]
            self.assertEqual(len(convs), 1)
            self.assertEqual(convs[0]["op"]["Conv"]["groups"], 3)
            self.assertEqual(convs[0]["path"], "attn.conv_lambda")
            for n in (batch, 3):
                x = np.random.default_rng(n).uniform(-1, 1, (n, 2, 5, 4, 3)).astype(np.float32)
                got = run(graph, b.graph.weights, x)["output"]
                np.testing.assert_allclose(got, conv3d(x, W, B, (1, 1, 0)), rtol=1e-5, atol=1e-5)

    def test_a_3d_convolution_over_every_dim_is_refused_with_its_kernel(self):
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 2, 5, 4, 3)), (2, 2, 5, 4, 3))
        b.begin("aten.convolution.default", "convolution", "c", True, (2, 4, 5, 4, 3))
        with self.assertRaisesRegex(Unsupported, r"kernel \[3, 3, 3\]"):
            ops.TABLE["aten.convolution.default"](b, {
                "input": x, "weight": Const("c.weight", np.zeros((4, 2, 3, 3, 3), np.float32)), "bias": None,
                "stride": [1, 1, 1], "padding": [1, 1, 1], "dilation": [1, 1, 1], "transposed": False,
                "output_padding": [0, 0, 0], "groups": 1})


if __name__ == "__main__":
    unittest.main()
