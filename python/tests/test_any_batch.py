"""A graph exported at batch 2 runs at any batch (issue 42), without torch: the converters are called
as the exporter calls them on the ATen nodes of the batch-moving patterns, and the Kiln graph they
build is run by a small NumPy model of the Kiln ops involved at batch 2 and at batch 5, against
the PyTorch semantics written in NumPy. `KILN_BLESS=1` rewrites the fixtures tests/any_batch.rs
runs on Kiln's own CPU executor."""

import json
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kiln_torch import graph as kg  # noqa: E402
from kiln_torch import ops  # noqa: E402
from kiln_torch.convert import Builder, merge_constant_adds, reshaped_bdim  # noqa: E402
from kiln_torch.graph import Act, Const  # noqa: E402
from kiln_torch.ops import Unsupported  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures")


def call(b, target, out, **args):
    """One ATen node through its converter, as `frontend.Converter.call` does."""
    b.begin(target, target.split(".")[1], "blk", False, out)
    return ops.TABLE[target](b, args)


def run_kiln(graph, weights, feeds):
    """The Kiln graph on NumPy inputs: the ops these patterns use, with Kiln's semantics (a
    Reshape's dims leave out the batch; every other attribute counts it)."""
    values = []
    for node in graph["nodes"]:
        (family, body), = node["op"].items()
        xs = [values[i] for i in node["inputs"]]
        if family == "Input":
            v = feeds[body["name"]]
        elif family == "Weight":
            v = weights[body["name"]]
        elif family == "Unary":
            simple = {"Relu": lambda x: np.maximum(x, 0), "Abs": np.abs, "Sqrt": np.sqrt}
            if isinstance(body, str) and body in simple:
                v = simple[body](xs[0])
            elif "Pow" in body:
                v = xs[0] ** body["Pow"]["exponent"]
            else:
                v = xs[0] * body["Affine"]["scale"] + body["Affine"]["shift"]
        elif family == "Binary":
            v = {"Add": np.add, "Mul": np.multiply}[body](xs[0], xs[1])
        elif family == "Gemm" and body == "Matmul":
            v = np.matmul(xs[0], xs[1])
        elif family == "Pool":
            (kind, m), = body.items()
            reduce = {"Mean": np.mean, "Amax": np.max}[kind]
            v = reduce(xs[0].astype(np.float64), axis=tuple(m["dims"]), keepdims=m["keepdim"])
        else:
            (kind, a), = body.items()
            x = xs[0]
            if kind == "Reshape":
                v = x.reshape([x.shape[0]] + a["dims"])
            elif kind == "Permute":
                v = x.transpose(a["dims"])
            elif kind == "Cat":
                v = np.concatenate(xs, axis=a["dim"])
            elif kind == "Slice":
                v = np.take(x, range(a["start"], a["start"] + a["len"]), axis=a["dim"])
            elif kind == "Pad":
                pads = a["pads"]
                width = [(0, 0)] * (x.ndim - len(pads) // 2) + [(pads[i], pads[i + 1]) for i in range(len(pads) - 2, -1, -2)]
                v = np.pad(x, width, constant_values=a["value"])
            elif kind == "Softmax":
                e = np.exp(x - x.max(axis=a["dim"], keepdims=True))
                v = e / e.sum(axis=a["dim"], keepdims=True)
            else:
                raise AssertionError(f"the model has no {kind}")
        values.append(np.asarray(v, np.float32))
    return {name: values[i] for name, i in graph["outputs"]}


def stack_sum(batch=2):
    """`torch.stack([x, relu(x), 2 * x]).sum(0)`: segmentation_models_pytorch's FPN merge."""
    b = Builder()
    b.batch = batch
    shape = (batch, 4, 3, 3)
    x = Act(b.graph.input("x", shape), shape)
    parts = [x, call(b, "aten.relu.default", shape, self=x), call(b, "aten.mul.Tensor", shape, self=x, other=2)]
    # torch.export decomposes stack into unsqueeze(0) and cat(0).
    lifted = [call(b, "aten.unsqueeze.default", (1,) + shape, self=p, dim=0) for p in parts]
    stacked = call(b, "aten.cat.default", (3,) + shape, tensors=lifted, dim=0)
    y = call(b, "aten.sum.dim_IntList", shape, self=stacked, dim=[0], keepdim=False)
    b.graph.mark_output("output", b.unlift(y).id)
    return b.graph


def stack_sum_reference(x):
    return x + np.maximum(x, 0) + 2 * x


STATE_BIAS = (np.arange(6, dtype=np.float32) % 4 - 1.5) / 10  # one row, the same for every sequence


def rnn_state(batch=2):
    """An LSTM step of timm's Sequencer2d: the images' rows `[B, 3, 6]` as `[B·3, 6]` sequences (the
    batch merged with the rows), plus the folded `h0 @ W_hh + b` of the zero initial state, a
    constant `[1, B·3, 6]` of more dims than the step (its rows equal: one per sequence), the step
    added again (values of two ranks), a per-row constant `[1, 1, 6]`, and the sequences viewed as
    images again."""
    b = Builder()
    b.batch = batch
    x = Act(b.graph.input("x", (batch, 3, 6)), (batch, 3, 6))
    t = call(b, "aten.view.default", (batch * 3, 6), self=x, size=[batch * 3, 6])
    h0 = Const("rnn.h0_gates", np.broadcast_to(STATE_BIAS, (1, batch * 3, 6)).copy())
    g = call(b, "aten.add.Tensor", (1, batch * 3, 6), self=t, other=h0, alpha=1)
    t = call(b, "aten.add.Tensor", (1, batch * 3, 6), self=g, other=t, alpha=1)
    t = call(b, "aten.mul.Tensor", (1, batch * 3, 6), self=t, other=Const("rnn.scale", np.full((1, 1, 6), 2.0, np.float32)))
    y = call(b, "aten.view.default", (batch, 3, 6), self=t, size=[batch, 3, 6])
    b.graph.mark_output("output", b.unlift(y).id)
    return b.graph


def rnn_state_reference(x):
    return (2 * x + STATE_BIAS) * 2.0


CLS = np.arange(6, dtype=np.float32).reshape(1, 1, 6) / 10


def token_qkv(batch=2):
    """ViT's first steps: the class token `expand`ed to the batch (folded to a constant of the
    example batch) and cat in front, then `qkv.reshape(B, N, 3, D).permute(2, 0, 1, 3).unbind(0)`
    (the batch moves to dim 1 and back), `q * k + v`."""
    b = Builder()
    b.batch = batch
    x = Act(b.graph.input("x", (batch, 4, 6)), (batch, 4, 6))
    cls = Const("cls_token.expand", np.broadcast_to(CLS, (batch, 1, 6)).copy())
    t = call(b, "aten.cat.default", (batch, 5, 6), tensors=[cls, x], dim=1)
    t = call(b, "aten.view.default", (batch, 5, 3, 2), self=t, size=[batch, 5, 3, 2])
    t = call(b, "aten.permute.default", (3, batch, 5, 2), self=t, dims=[2, 0, 1, 3])
    q, k, v = (p() for p in call(b, "aten.unbind.int", (batch, 5, 2), self=t, dim=0))
    y = call(b, "aten.mul.Tensor", (batch, 5, 2), self=q, other=k)
    y = call(b, "aten.add.Tensor", (batch, 5, 2), self=y, other=v, alpha=1)
    b.graph.mark_output("output", b.unlift(y).id)
    merge_constant_adds(b.graph, b.cat_constant_adds)
    return b.graph


def token_qkv_reference(x):
    t = np.concatenate([np.broadcast_to(CLS, (x.shape[0], 1, 6)), x], axis=1).reshape(x.shape[0], 5, 3, 2)
    q, k, v = t[:, :, 0], t[:, :, 1], t[:, :, 2]
    return q * k + v


WINDOW_BIAS = (np.arange(4 * 4, dtype=np.float32).reshape(4, 1, 4) % 5) / 10  # [windows, 1, C]
ROW_SCALE = np.array([1.0, 0.5, 2.0, -1.0], np.float32).reshape(4, 1, 1)  # per window, expanded to every image


def windows(batch=2):
    """Window attention's batch merge (timm's Swin): `[B, 4, 4, C]` partitioned into 2×2 windows
    as `[B·4, 4, C]` (the batch merged with the windows), a per-window constant `expand`ed to
    every image (folded to `[B·4, 1, 1]`), a softmax within each window, the windows viewed as
    `[B, 4, 4, C]` for a bias per window, and the partition reversed."""
    b = Builder()
    b.batch = batch
    x = Act(b.graph.input("x", (batch, 4, 4, 4)), (batch, 4, 4, 4))
    t = call(b, "aten.view.default", (batch, 2, 2, 2, 2, 4), self=x, size=[batch, 2, 2, 2, 2, 4])
    t = call(b, "aten.permute.default", (batch, 2, 2, 2, 2, 4), self=t, dims=[0, 1, 3, 2, 4, 5])
    t = call(b, "aten.view.default", (batch * 4, 4, 4), self=t, size=[-1, 4, 4])
    scale = Const("row_scale.expand", np.tile(ROW_SCALE, (batch, 1, 1)))
    t = call(b, "aten.mul.Tensor", (batch * 4, 4, 4), self=t, other=scale)
    t = call(b, "aten.softmax.int", (batch * 4, 4, 4), self=t, dim=1, half_to_float=False)
    t = call(b, "aten.view.default", (batch, 4, 4, 4), self=t, size=[-1, 4, 4, 4])
    t = call(b, "aten.add.Tensor", (batch, 4, 4, 4), self=t, other=Const("window_bias", WINDOW_BIAS[None]), alpha=1)
    t = call(b, "aten.view.default", (batch, 2, 2, 2, 2, 4), self=t, size=[batch, 2, 2, 2, 2, 4])
    t = call(b, "aten.permute.default", (batch, 2, 2, 2, 2, 4), self=t, dims=[0, 1, 3, 2, 4, 5])
    y = call(b, "aten.view.default", (batch, 4, 4, 4), self=t, size=[batch, 4, 4, 4])
    b.graph.mark_output("output", b.unlift(y).id)
    return b.graph


def windows_reference(x):
    n = x.shape[0]
    t = x.reshape(n, 2, 2, 2, 2, 4).transpose(0, 1, 3, 2, 4, 5).reshape(n * 4, 4, 4)
    t = t * np.tile(ROW_SCALE, (n, 1, 1))
    e = np.exp(t - t.max(axis=1, keepdims=True))
    t = (e / e.sum(axis=1, keepdims=True)).reshape(n, 4, 4, 4) + WINDOW_BIAS[None]
    return t.reshape(n, 2, 2, 2, 2, 4).transpose(0, 1, 3, 2, 4, 5).reshape(n, 4, 4, 4)


REL_H = (np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5) % 7 - 3) / 10  # [H, C, K]


def einsum_rows(batch=2):
    """MViTv2's relative positions, `torch.einsum("bhwc,hck->bhwk", q, rel_h)` as torch.export
    writes it: the batch moved behind `h` and merged with `w` for one batched matmul with the
    constant (`[H, B·W, C] @ [H, C, K]`), then split off and moved back."""
    b = Builder()
    b.batch = batch
    x = Act(b.graph.input("x", (batch, 3, 2, 4)), (batch, 3, 2, 4))
    t = call(b, "aten.permute.default", (3, batch, 2, 4), self=x, dims=[1, 0, 2, 3])
    t = call(b, "aten.view.default", (3, batch * 2, 4), self=t, size=[3, batch * 2, 4])
    t = call(b, "aten.bmm.default", (3, batch * 2, 5), self=t, mat2=Const("rel_h", REL_H))
    t = call(b, "aten.view.default", (3, batch, 2, 5), self=t, size=[3, batch, 2, 5])
    y = call(b, "aten.permute.default", (batch, 3, 2, 5), self=t, dims=[1, 0, 2, 3])
    b.graph.mark_output("output", b.unlift(y).id)
    return b.graph


def einsum_rows_reference(x):
    return np.einsum("bhwc,hck->bhwk", x, REL_H)


PATTERNS = {
    "einsum_rows": (einsum_rows, einsum_rows_reference, (3, 2, 4)),
    "rnn_state": (rnn_state, rnn_state_reference, (3, 6)),
    "stack_sum": (stack_sum, stack_sum_reference, (4, 3, 3)),
    "token_qkv": (token_qkv, token_qkv_reference, (4, 6)),
    "windows": (windows, windows_reference, (4, 4, 4)),
}


class AnyBatch(unittest.TestCase):
    def test_each_pattern_exported_at_batch_2_runs_at_batch_2_and_5(self):
        for name, (build, reference, dims) in PATTERNS.items():
            g = build(2)
            graph = g.to_json()
            for n in graph["nodes"]:
                if "Weight" not in n["op"]:
                    self.assertEqual(n["shape"][0], 2, f"{name}: Kiln's dim 0 is the batch in {n}")
            for batch in (2, 5):
                x = np.random.default_rng(batch).uniform(-1, 1, (batch,) + dims).astype(np.float32)
                got = run_kiln(graph, g.weights, {"x": x})["output"]
                np.testing.assert_allclose(got, reference(x), rtol=1e-6, atol=1e-6, err_msg=f"{name} at batch {batch}")

    def test_the_fixtures_of_tests_any_batch_rs_are_these_graphs(self):
        for name, (build, reference, dims) in PATTERNS.items():
            g = build(2)
            x = np.random.default_rng(0).uniform(-1, 1, (3,) + dims).astype(np.float32)
            data = kg.encode(g, {"model": name, "kiln.tool": "tests/test_any_batch.py"})
            ref = kg.encode_reference({"x": x}, {"output": reference(x)}, {"model": name})
            paths = [os.path.join(FIXTURES, f"any_batch_{name}{ext}") for ext in (".kiln.safetensors", ".reference.safetensors")]
            if os.environ.get("KILN_BLESS"):
                for path, content in zip(paths, (data, ref)):
                    with open(path, "wb") as f:
                        f.write(content)
            for path, content in zip(paths, (data, ref)):
                with open(path, "rb") as f:
                    self.assertEqual(f.read(), content, f"{path} is stale: KILN_BLESS=1 python3 -m unittest discover -s python/tests")

    def test_the_batch_moves_with_permute_and_reshape_and_comes_back(self):
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 5, 3, 4)), (2, 5, 3, 4))
        y = b.permute(x, [2, 0, 1, 3])
        self.assertEqual((y.tshape, y.bdim, y.kshape), ((3, 2, 5, 4), 1, [2, 3, 5, 4]))
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Shape": {"Permute": {"dims": [0, 2, 1, 3]}}})
        self.assertEqual([y.kdim(d) for d in range(4)], [1, 0, 2, 3])
        z = b.permute(y, [1, 0, 2, 3])
        self.assertEqual((z.tshape, z.bdim), ((2, 3, 5, 4), 0))
        self.assertEqual(reshaped_bdim((3, 2, 5, 4), 1, (3, 2, 20)), 1, "what follows the batch reshapes freely")
        self.assertEqual(reshaped_bdim((2, 4), 0, (1, 2, 4)), 1, "unsqueeze(0)")
        self.assertEqual(reshaped_bdim((1, 2, 1, 4), 1, (2, 4)), 0, "squeeze")
        self.assertIsNone(reshaped_bdim((3, 2, 5), 1, (6, 5)), "merged with another dim")

    def test_what_cannot_follow_a_moved_batch_is_a_report_line_not_a_wrong_graph(self):
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 3, 4)), (2, 3, 4))
        y = b.permute(x, [1, 0, 2])
        with self.assertRaisesRegex(Unsupported, "moved to dim 1"):
            call(b, "aten.layer_norm.default", (3, 2, 4), input=y, normalized_shape=[4], weight=None, bias=None, eps=1e-5)
        with self.assertRaisesRegex(Unsupported, "the batch"):
            call(b, "aten.sum.dim_IntList", (3, 4), self=y, dim=[1], keepdim=False)
        with self.assertRaisesRegex(Unsupported, "batch in dim 1"):
            b.unlift(y)
        with self.assertRaisesRegex(Unsupported, "differs along the batch"):
            b.binary("Add", y, Const("c", np.arange(8, dtype=np.float32).reshape(1, 2, 4)))
        with self.assertRaisesRegex(Unsupported, "mixes the images"):
            call(b, "aten.softmax.int", (3, 2, 4), self=y, dim=1, half_to_float=False)

    def test_stack_exported_at_batch_2_is_the_cat_of_unsqueezed_values(self):
        # `torch.stack([x, relu(x)]).mean(0)` as aten.stack (CrossViT's heads): the batch moves to dim 1 and back.
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 4)), (2, 4))
        r = call(b, "aten.relu.default", (2, 4), self=x)
        s = call(b, "aten.stack.default", (2, 2, 4), tensors=[x, r], dim=0)
        self.assertEqual((s.tshape, s.bdim, s.kshape), ((2, 2, 4), 1, [2, 2, 4]))
        y = call(b, "aten.mean.dim", (2, 4), self=s, dim=[0], keepdim=False)
        b.graph.mark_output("output", b.unlift(y).id)
        for batch in (2, 5):
            xv = np.random.default_rng(batch).uniform(-1, 1, (batch, 4)).astype(np.float32)
            got = run_kiln(b.graph.to_json(), b.graph.weights, {"x": xv})["output"]
            np.testing.assert_allclose(got, (xv + np.maximum(xv, 0)) / 2, rtol=1e-6, atol=1e-7)

    def test_unfold_is_its_windows_side_by_side(self):
        # `x.unfold(2, 6, 4)` of [B, 3, 10, 4]: windows 0..5 and 4..9 of dim 2, each moved last.
        for batch in (1, 2):
            b = Builder()
            b.batch = batch
            x = Act(b.graph.input("x", (batch, 3, 10, 4)), (batch, 3, 10, 4))
            y = call(b, "aten.unfold.default", (batch, 3, 2, 4, 6), self=x, dimension=2, size=6, step=4)
            b.graph.mark_output("output", b.unlift(y).id)
            xv = np.random.default_rng(batch).uniform(-1, 1, (batch, 3, 10, 4)).astype(np.float32)
            got = run_kiln(b.graph.to_json(), b.graph.weights, {"x": xv})["output"]
            want = np.stack([xv[:, :, 4 * i : 4 * i + 6].transpose(0, 1, 3, 2) for i in range(2)], axis=2)
            np.testing.assert_array_equal(got, want)

    def test_copy_is_its_source_broadcast_to_the_destination(self):
        # `z.copy_(src)` of a [B, 1, 3, 4] source into a [B, 2, 3, 4] value; a same-shape copy
        # (a slice assignment over the whole tensor) is the source itself.
        for batch in (1, 2):
            b = Builder()
            b.batch = batch
            x = Act(b.graph.input("x", (batch, 2, 3, 4)), (batch, 2, 3, 4))
            src = Act(b.graph.input("s", (batch, 1, 3, 4)), (batch, 1, 3, 4))
            self.assertIs(call(b, "aten.copy.default", (batch, 2, 3, 4), self=x, src=x), x)
            y = call(b, "aten.copy.default", (batch, 2, 3, 4), self=x, src=src)
            b.graph.mark_output("output", b.unlift(y).id)
            rng = np.random.default_rng(batch)
            xv, sv = (rng.uniform(-1, 1, s).astype(np.float32) for s in ((batch, 2, 3, 4), (batch, 1, 3, 4)))
            got = run_kiln(b.graph.to_json(), b.graph.weights, {"x": xv, "s": sv})["output"]
            np.testing.assert_array_equal(got, np.broadcast_to(sv, xv.shape))

    def test_flip_reverses_each_dim_and_refuses_the_batch(self):
        for batch in (1, 2):
            b = Builder()
            b.batch = batch
            x = Act(b.graph.input("x", (batch, 3, 5, 4)), (batch, 3, 5, 4))
            y = call(b, "aten.flip.default", (batch, 3, 5, 4), self=x, dims=[-1, 2])
            b.graph.mark_output("output", b.unlift(y).id)
            xv = np.random.default_rng(batch).uniform(-1, 1, (batch, 3, 5, 4)).astype(np.float32)
            got = run_kiln(b.graph.to_json(), b.graph.weights, {"x": xv})["output"]
            np.testing.assert_array_equal(got, xv[:, :, ::-1, ::-1])
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 3)), (2, 3))
        with self.assertRaises(Unsupported):
            call(b, "aten.flip.default", (2, 3), self=x, dims=[0])

    def test_a_batch_merged_with_windows_is_held_image_by_image(self):
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 3, 4)), (2, 3, 4))
        w = call(b, "aten.view.default", (6, 4), self=x, size=[6, 4])
        self.assertEqual((w.lifted, w.bdim, w.kshape), (True, 0, [2, 3, 4]))
        self.assertEqual(b.graph.nodes[w.id]["op"], {"Shape": {"Reshape": {"dims": [3, 4]}}})
        with self.assertRaisesRegex(Unsupported, "mixes the images"):
            call(b, "aten.sum.dim_IntList", (4,), self=w, dim=[0], keepdim=False)
        with self.assertRaisesRegex(Unsupported, "splits the images"):
            call(b, "aten.view.default", (3, 8), self=w, size=[3, 8])
        with self.assertRaisesRegex(Unsupported, "differs between the images"):
            b.binary("Add", w, Const("c", np.arange(6, dtype=np.float32).reshape(6, 1)))
        back = call(b, "aten.view.default", (2, 12), self=w, size=[2, 12])
        self.assertEqual((back.lifted, back.kshape), (False, [2, 12]))

    def test_a_constant_expanded_to_the_batch_is_read_per_image(self):
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 4)), (2, 4))
        mask = Const("mask", np.array([[1, 0, 1, 0]] * 2, np.float32))
        y = b.binary("Mul", x, mask)
        w = b.graph.nodes[b.graph.nodes[y.id]["inputs"][1]]
        self.assertEqual((w["op"], w["shape"]), ({"Weight": {"name": "mask.per_image"}}, [1, 4]))
        with self.assertRaisesRegex(Unsupported, "differs between the images"):
            b.binary("Mul", x, Const("per_row", np.array([[1, 0, 1, 0], [0, 1, 0, 1]], np.float32)))

    def test_a_constant_of_more_dims_than_the_value_broadcasts_per_image(self):
        # Lifted (the batch merged with rows): the value takes the constant's leading dim of 1.
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 3, 4)), (2, 3, 4))
        w = call(b, "aten.view.default", (6, 4), self=x, size=[6, 4])
        y = b.binary("Add", w, Const("h0", np.ones((1, 6, 4), np.float32)))
        self.assertEqual((y.tshape, y.lifted, y.bdim, y.kshape), ((1, 6, 4), True, 1, [2, 1, 3, 4]))
        with self.assertRaisesRegex(Unsupported, "differs between the images"):
            b.binary("Add", w, Const("h0", np.arange(24, dtype=np.float32).reshape(1, 6, 4)))
        # The batch first: after the constant's leading dims, it is a moved batch.
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 4)), (2, 4))
        y = b.binary("Mul", x, Const("c", np.full((3, 2, 4), 0.5, np.float32)))
        self.assertEqual((y.tshape, y.bdim, y.kshape), ((3, 2, 4), 1, [2, 3, 4]))
        with self.assertRaisesRegex(Unsupported, "differs along the batch"):
            b.binary("Mul", x, Const("c", np.arange(24, dtype=np.float32).reshape(3, 2, 4)))


if __name__ == "__main__":
    unittest.main()
