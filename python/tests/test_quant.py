"""Quantised PyTorch models (issue 38 item 4), without torch: PT2E's quantize/dequantize pairs, its
int8 weights and QAT's fake-quantisers onto Kiln's `Quant` ops and weight grids. The converters are
called with their arguments by name, as the exporter calls them (`_named_args` writes dtypes as
`int8`); tools/pt2e_check.py runs the same mapping on real PT2E models."""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kiln_torch import graph as kg  # noqa: E402
from kiln_torch import ops  # noqa: E402
from kiln_torch.convert import Builder  # noqa: E402
from kiln_torch.graph import Act, Const  # noqa: E402
from kiln_torch.ops import Unsupported  # noqa: E402

Q = "quantized_decomposed.quantize_per_tensor.default"
DQ = "quantized_decomposed.dequantize_per_tensor.default"


def builder(shape, scope="blk"):
    b = Builder()
    x = Act(b.graph.input("input", shape), tuple(shape))
    b.begin("aten.x", "node", scope, False, shape)
    return b, x


def quant(node):
    (kind, params), = node["op"]["Quant"].items()
    return kind, params


def per_tensor(x, scale=0.05, zp=0, qmin=-128, qmax=127, dtype="int8"):
    """A `quantize_per_tensor` / `dequantize_per_tensor` argument set as convert_pt2e writes it
    (its observer's scale as a Python float)."""
    return {"input": x, "scale": scale, "zero_point": zp, "quant_min": qmin, "quant_max": qmax, "dtype": dtype}


class Pt2eActivations(unittest.TestCase):
    def test_a_quantize_dequantize_pair_is_one_fake_quantiser_of_the_value(self):
        b, x = builder([1, 16, 8, 8])
        relu = b.node(ops.unary("Relu"), [x], "relu")
        q = ops.TABLE[Q](b, per_tensor(relu, 0.0291))
        d = ops.TABLE[DQ](b, per_tensor(q, 0.0291))
        node = b.graph.nodes[d.id]
        kind, params = quant(node)
        self.assertEqual(kind, "FakeQuantize")
        self.assertEqual(params, {"format": "Int8", "scale": [0.0291], "zero_point": [0], "axis": None, "qmin": -128, "qmax": 127})
        # It reads the value itself, not the codes, and is named after it.
        self.assertEqual(node["inputs"], [relu.id])
        self.assertEqual(node["path"], "blk.relu.quantizer")
        self.assertEqual((d.tshape, d.lifted), (relu.tshape, False))
        # The quantize is read by no one now: the exporter's compaction drops it.
        b.graph.mark_output("out", d.id)
        b.graph.compact()
        kinds = [kg.op_name(n["op"]) for n in b.graph.nodes]
        self.assertEqual(kinds, ["input", "Unary.Relu", "Quant.FakeQuantize"], kinds)

    def test_every_readers_dequantize_shares_one_fake_quantiser(self):
        """PT2E gives each reader of a quantised value its own dequantize."""
        b, x = builder([1, 16, 8, 8])
        q = ops.TABLE[Q](b, per_tensor(x))
        d1, d2 = ops.TABLE[DQ](b, per_tensor(q)), ops.TABLE[DQ](b, per_tensor(q))
        self.assertEqual(d1.id, d2.id)
        fq = [n for n in b.graph.nodes if "Quant" in n["op"] and "FakeQuantize" in n["op"]["Quant"]]
        self.assertEqual(len(fq), 1)

    def test_affine_zero_points_and_uint8_are_kept(self):
        b, x = builder([1, 4])
        q = ops.TABLE[Q](b, per_tensor(x, 0.1, zp=-3))
        _, params = quant(b.graph.nodes[ops.TABLE[DQ](b, per_tensor(q, 0.1, zp=-3)).id])
        self.assertEqual((params["zero_point"], params["qmin"], params["qmax"]), ([-3], -128, 127))
        q = ops.TABLE[Q](b, per_tensor(x, 0.1, zp=128, qmin=0, qmax=255, dtype="uint8"))
        _, params = quant(b.graph.nodes[ops.TABLE[DQ](b, per_tensor(q, 0.1, zp=128, qmin=0, qmax=255, dtype="uint8")).id])
        self.assertEqual((params["zero_point"], params["qmin"], params["qmax"]), ([128], 0, 255))

    def test_a_dequantize_with_other_parameters_or_of_other_codes_stays_a_dequantize(self):
        b, x = builder([1, 4])
        q = ops.TABLE[Q](b, per_tensor(x, 0.1))
        d = ops.TABLE[DQ](b, per_tensor(q, 0.2))
        kind, params = quant(b.graph.nodes[d.id])
        self.assertEqual((kind, params["scale"], b.graph.nodes[d.id]["inputs"]), ("Dequantize", [0.2], [q.id]))
        # Codes that are the model's input (already integers): a plain dequantize.
        d = ops.TABLE[DQ](b, per_tensor(x, 0.5))
        self.assertEqual(quant(b.graph.nodes[d.id])[0], "Dequantize")

    def test_the_tensor_overloads_take_one_element_constants(self):
        b, x = builder([1, 4])
        scale = Const("s", np.array(0.25, np.float32))
        zp = Const("z", np.array(0, np.int64))
        q = ops.TABLE["quantized_decomposed.quantize_per_tensor.tensor"](b, per_tensor(x, scale, zp))
        d = ops.TABLE["quantized_decomposed.dequantize_per_tensor.tensor"](b, per_tensor(q, scale, zp))
        self.assertEqual(quant(b.graph.nodes[d.id]), ("FakeQuantize", {"format": "Int8", "scale": [0.25], "zero_point": [0],
                                                                       "axis": None, "qmin": -128, "qmax": 127}))

    def test_per_channel_activations_map_their_axis_past_the_batch(self):
        b, x = builder([1, 3, 4, 4])
        args = {"input": x, "scales": Const("s", np.array([0.1, 0.2, 0.3], np.float32)),
                "zero_points": Const("z", np.zeros(3, np.int64)), "axis": -3, "quant_min": -127, "quant_max": 127, "dtype": "int8"}
        q = ops.TABLE["quantized_decomposed.quantize_per_channel.default"](b, args)
        d = ops.TABLE["quantized_decomposed.dequantize_per_channel.default"](b, dict(args, input=q))
        kind, params = quant(b.graph.nodes[d.id])
        self.assertEqual((kind, params["axis"], params["scale"], params["qmin"]), ("FakeQuantize", 1, np.float32([0.1, 0.2, 0.3]).tolist(), -127))
        # Along PyTorch's dim 0 (the batch, 1 here): the value is lifted and the axis is Kiln's 1.
        q = ops.TABLE["quantized_decomposed.quantize_per_channel.default"](
            b, dict(args, axis=0, scales=Const("s1", np.array([0.5], np.float32)), zero_points=Const("z1", np.zeros(1, np.int64))))
        self.assertEqual((quant(b.graph.nodes[q.id])[1]["axis"], b.graph.nodes[q.id]["shape"]), (1, [1, 1, 3, 4, 4]))

    def test_what_kiln_cannot_hold_is_refused_with_the_reason(self):
        b, x = builder([1, 4])
        with self.assertRaisesRegex(Unsupported, "quantisation to int16: Kiln's 8-bit formats"):
            ops.TABLE[Q](b, per_tensor(x, qmin=-32768, qmax=32767, dtype="int16"))
        with self.assertRaisesRegex(Unsupported, r"the range \[-128, 127\] does not fit uint8"):
            ops.TABLE[Q](b, per_tensor(x, dtype="uint8"))
        with self.assertRaisesRegex(Unsupported, r"zero points \[200\] outside \[-128, 127\]"):
            ops.TABLE[Q](b, per_tensor(x, zp=200))
        with self.assertRaisesRegex(Unsupported, "a dequantize to bfloat16"):
            ops.TABLE[DQ](b, dict(per_tensor(x), out_dtype="bfloat16"))
        with self.assertRaisesRegex(Unsupported, "computed from the input"):
            ops.TABLE[Q](b, per_tensor(x, scale=x))  # dynamic quantisation (choose_qparams)


class WeightGrids(unittest.TestCase):
    def test_a_pt2e_weight_keeps_its_per_channel_grid(self):
        codes = Const("_frozen_param0", np.array([[[[-127]]], [[[5]]]], np.int8))
        args = {"input": codes, "scales": Const("_scale_0", np.array([0.01, 0.02], np.float32)),
                "zero_points": Const("_zero_point_0", np.zeros(2, np.int64)), "axis": 0, "quant_min": -127, "quant_max": 127,
                "dtype": "int8", "out_dtype": None}
        grid = ops.weight_grid("quantized_decomposed.dequantize_per_channel.default", args)  # the f32 scales, exactly
        self.assertEqual(grid, {"format": "Int8", "scale": [float(np.float32(0.01)), float(np.float32(0.02))],
                                "zero_point": [0, 0], "axis": 0, "qmin": -127, "qmax": 127})

    def test_a_qat_weight_fake_quantised_by_pytorch_keeps_its_grid(self):
        w = Const("conv.weight", np.ones([4, 3, 3, 3], np.float32))
        args = {"self": w, "scale": Const("w.scale", np.full(4, 0.1, np.float32)), "zero_point": Const("w.zp", np.zeros(4, np.int32)),
                "axis": 0, "quant_min": -127, "quant_max": 127}
        grid = ops.weight_grid("aten.fake_quantize_per_channel_affine.default", args)
        self.assertEqual((grid["axis"], len(grid["scale"]), grid["qmin"]), (0, 4, -127))
        grid = ops.weight_grid("aten.fake_quantize_per_tensor_affine.default",
                               {"self": w, "scale": 0.5, "zero_point": 0, "quant_min": -128, "quant_max": 127})
        self.assertEqual((grid["axis"], grid["scale"]), (None, [0.5]))

    def test_other_folded_ops_have_no_grid(self):
        w = Const("w", np.ones([2, 2], np.float32))
        self.assertIsNone(ops.weight_grid("aten.t.default", {"self": w}))
        self.assertIsNone(ops.weight_grid("quantized_decomposed.dequantize_per_tensor.default", per_tensor(Act(0, (1, 2)))))

    def test_a_weight_on_a_grid_is_a_weight_node_with_quant(self):
        b, x = builder([1, 3, 8, 8])
        grid = {"format": "Int8", "scale": [0.01] * 4, "zero_point": [0] * 4, "axis": 0, "qmin": -127, "qmax": 127}
        w = Const("dequantize_per_channel", np.zeros([4, 3, 3, 3], np.float32), grid)
        y = ops.TABLE["aten.conv2d.default"](b, {"input": x, "weight": w, "bias": None, "stride": [1, 1], "padding": [1, 1],
                                                 "dilation": [1, 1], "groups": 1})
        wnode = b.graph.nodes[b.graph.nodes[y.id]["inputs"][1]]
        self.assertEqual(wnode["op"], {"Weight": {"name": "dequantize_per_channel", "quant": grid}})
        # One name, one grid.
        other = dict(grid, scale=[0.02] * 4)
        with self.assertRaisesRegex(ValueError, "two different 8-bit grids"):
            b.graph.weight("dequantize_per_channel", np.zeros([4, 3, 3, 3], np.float32), other)


if __name__ == "__main__":
    unittest.main()
