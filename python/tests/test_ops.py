"""The op table and the converters' Kiln nodes, without torch: converters are called with their
arguments by name, as the exporter calls them, on a `Builder` over a graph with one input."""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kiln_torch import ops  # noqa: E402
from kiln_torch.convert import Builder  # noqa: E402
from kiln_torch.graph import Act, Const  # noqa: E402
from kiln_torch.ops import Unsupported  # noqa: E402


def builder(shape, scope="blk", leaf=False, target="aten.x", out=None):
    b = Builder()
    x = Act(b.graph.input("input", shape), tuple(shape))
    b.begin(target, "node", scope, leaf, out if out is not None else shape)
    return b, x


def family(node):
    (name, body), = node["op"].items()
    return name, body


class OpTable(unittest.TestCase):
    def test_every_op_kiln_imports_has_a_converter(self):
        for name in ["aten.conv2d.default", "aten.linear.default", "aten._native_batch_norm_legit_no_training.default",
                     "aten.relu.default", "aten.add.Tensor", "aten.view.default", "aten.cat.default", "aten.split.Tensor",
                     "aten.scaled_dot_product_attention.default", "aten.upsample_bilinear2d.vec", "torchvision.deform_conv2d.default",
                     "aten.softplus.default", "aten.fake_quantize_per_channel_affine.default"]:
            self.assertIsNotNone(ops.lookup(name), name)
        self.assertIsNone(ops.lookup("aten.cumsum.default"))

    def test_a_user_table_comes_first_and_matches_every_overload(self):
        user = ops.custom_table({"mylib::swish": "swish", "aten.erf.default": ops.CustomOp("erf")})
        self.assertEqual(ops.find("mylib.swish.default", user).name, "swish")
        self.assertEqual(ops.find("aten.erf.default", user).name, "erf")
        self.assertIs(ops.find("aten.relu.default", user), ops.TABLE["aten.relu.default"])

    def test_registering_a_name_twice_is_an_error(self):
        with self.assertRaises(ValueError):
            ops.aten("aten.relu.default")(lambda cx, a: None)


class Converters(unittest.TestCase):
    def test_a_leaf_modules_op_takes_the_module_path(self):
        b, x = builder([1, 3, 8, 8], scope="features.0", leaf=True, out=(1, 4, 8, 8))
        w = Const("features.0.weight", np.zeros([4, 3, 3, 3], np.float32))
        y = ops.TABLE["aten.conv2d.default"](b, {"input": x, "weight": w, "bias": None, "stride": [1, 1], "padding": [1, 1],
                                                 "dilation": [1, 1], "groups": 1})
        node = b.graph.nodes[y.id]
        self.assertEqual(node["path"], "features.0")
        self.assertEqual(node["shape"], [1, 4, 8, 8])
        name, conv = family(node)
        self.assertEqual((name, conv["padding"], conv["bias"]), ("Conv", [1, 1], False))
        self.assertEqual(b.graph.nodes[node["inputs"][1]]["op"], {"Weight": {"name": "features.0.weight"}})

    def test_inline_ops_are_named_in_their_modules_scope(self):
        b, x = builder([1, 4], scope="layer1.0")
        y = ops.TABLE["aten.add.Tensor"](b, {"self": x, "other": x, "alpha": 1})
        self.assertEqual(b.graph.nodes[y.id]["path"], "layer1.0.add")
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Binary": "Add"})

    def test_arithmetic_with_a_number_is_one_affine(self):
        b, x = builder([1, 4])
        cases = [("aten.add.Tensor", 3, (1.0, 3.0)), ("aten.mul.Tensor", 0.5, (0.5, 0.0)), ("aten.sub.Tensor", 2, (1.0, -2.0))]
        for target, s, (scale, shift) in cases:
            y = ops.TABLE[target](b, {"self": x, "other": s, "alpha": 1})
            self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": {"Affine": {"scale": scale, "shift": shift}}}, target)
        y = ops.TABLE["aten.rsub.Scalar"](b, {"self": x, "other": 1, "alpha": 1})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": {"Affine": {"scale": -1.0, "shift": 1.0}}}, "1 - x")

    def test_a_constant_first_operand_of_a_commutative_op_goes_second(self):
        b, x = builder([1, 4, 2, 2], out=(1, 4, 2, 2))
        c = Const("layer_scale", np.ones([4, 1, 1], np.float32))
        y = ops.TABLE["aten.mul.Tensor"](b, {"self": c, "other": x})
        ins = b.graph.nodes[y.id]["inputs"]
        self.assertEqual(ins[0], x.id)
        self.assertEqual(b.graph.nodes[ins[1]]["op"], {"Weight": {"name": "layer_scale"}})

    def test_a_constant_minus_an_activation_negates_then_adds(self):
        # YOLO's `anchor_points - lt`: (-x) + c is c - x in f32, with the activation first.
        b, x = builder([1, 2, 4], out=(1, 2, 4))
        c = Const("anchors", np.ones([2, 4], np.float32))
        y = ops.TABLE["aten.sub.Tensor"](b, {"self": c, "other": x, "alpha": 1})
        add = b.graph.nodes[y.id]
        self.assertEqual(add["op"], {"Binary": "Add"})
        self.assertEqual(b.graph.nodes[add["inputs"][0]]["op"], {"Unary": {"Affine": {"scale": -1.0, "shift": 0.0}}})
        # c / x: a reciprocal, then the constant as a weight.
        y = ops.TABLE["aten.div.Tensor"](b, {"self": c, "other": x})
        mul = b.graph.nodes[y.id]
        self.assertEqual(mul["op"], {"Binary": "Mul"})
        self.assertEqual(b.graph.nodes[mul["inputs"][0]]["op"], {"Unary": "Reciprocal"})
        self.assertEqual(b.graph.nodes[mul["inputs"][1]]["op"], {"Weight": {"name": "anchors"}})

    def test_math_functions_are_unary_ops(self):
        b, x = builder([1, 4])
        for target, kind in [("aten.exp.default", "Exp"), ("aten.log.default", "Log"), ("aten.sqrt.default", "Sqrt"),
                             ("aten.rsqrt.default", "Rsqrt"), ("aten.reciprocal.default", "Reciprocal"), ("aten.abs.default", "Abs"),
                             ("aten.erf.default", "Erf"), ("aten.mish.default", "Mish")]:
            y = ops.TABLE[target](b, {"self": x})
            self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": kind}, target)
        y = ops.TABLE["aten.pow.Tensor_Scalar"](b, {"self": x, "exponent": 2})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": {"Pow": {"exponent": 2.0}}})
        self.assertIs(ops.TABLE["aten.pow.Tensor_Scalar"](b, {"self": x, "exponent": 1}), x)
        with self.assertRaisesRegex(Unsupported, "tensor exponent"):
            ops.TABLE["aten.pow.Tensor_Scalar"](b, {"self": x, "exponent": Const("e", np.ones([4], np.float32))})

    def test_a_number_over_an_activation_is_a_reciprocal_and_an_affine(self):
        b, x = builder([1, 4])
        y = ops.TABLE["aten.div.Tensor"](b, {"self": 2.0, "other": x})
        node = b.graph.nodes[y.id]
        self.assertEqual(node["op"], {"Unary": {"Affine": {"scale": 2.0, "shift": 0.0}}})
        self.assertEqual(b.graph.nodes[node["inputs"][0]]["op"], {"Unary": "Reciprocal"})
        y = ops.TABLE["aten.reciprocal.default"](b, {"self": x})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": "Reciprocal"})

    def test_adaptive_max_pooling_gives_its_values(self):
        b, x = builder([1, 3, 8, 8], out=(1, 3, 2, 2))
        y, indices = ops.TABLE["aten.adaptive_max_pool2d.default"](b, {"self": x, "output_size": [2, 2]})
        self.assertIsNone(indices)
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Pool": {"AdaptiveMax": {"output": [2, 2]}}})

    def test_reflect_and_replicate_pads(self):
        b, x = builder([1, 3, 8, 8], out=(1, 3, 10, 10))
        y = ops.TABLE["aten.pad.default"](b, {"self": x, "pad": [1, 1, 1, 1], "mode": "reflect", "value": None})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Shape": {"ReflectPad": {"pads": [1, 1, 1, 1]}}})
        y = ops.TABLE["aten.replication_pad2d.default"](b, {"self": x, "padding": [2, 0, 1, 1]})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Shape": {"ReplicatePad": {"pads": [2, 0, 1, 1]}}})
        self.assertEqual(b.graph.nodes[y.id]["path"], "blk.replication_pad")

    def test_group_norm_and_instance_norm(self):
        b, x = builder([1, 8, 4, 4])
        w = Const("gn.weight", np.ones([8], np.float32))
        bias = Const("gn.bias", np.zeros([8], np.float32))
        y = ops.TABLE["aten.group_norm.default"](b, {"input": x, "num_groups": 4, "weight": w, "bias": bias, "eps": 1e-5})
        node = b.graph.nodes[y.id]
        self.assertEqual(node["op"], {"Norm": {"GroupNorm": {"groups": 4, "eps": 1e-5, "affine": True}}})
        self.assertEqual(len(node["inputs"]), 3)
        y = ops.TABLE["aten.instance_norm.default"](b, {"input": x, "weight": None, "bias": None, "running_mean": None,
                                                        "running_var": None, "use_input_stats": True, "momentum": 0.1, "eps": 1e-5})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Norm": {"GroupNorm": {"groups": 8, "eps": 1e-5, "affine": False}}})

    def test_amax_argmax_and_max_dim(self):
        b, x = builder([1, 21, 4, 4], out=(1, 4, 4))
        y = ops.TABLE["aten.argmax.default"](b, {"self": x, "dim": 1, "keepdim": False})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Pool": {"Argmax": {"dim": 1, "keepdim": False}}})
        y = ops.TABLE["aten.amax.default"](b, {"self": x, "dim": [-1, 2], "keepdim": True})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Pool": {"Amax": {"dims": [2, 3], "keepdim": True}}})
        with self.assertRaisesRegex(Unsupported, "flattened"):
            ops.TABLE["aten.argmax.default"](b, {"self": x, "dim": None})
        values, indices = ops.TABLE["aten.max.dim"](b, {"self": x, "dim": 1})
        n = len(b.graph.nodes)
        self.assertEqual(b.graph.nodes[indices().id]["op"], {"Pool": {"Argmax": {"dim": 1, "keepdim": False}}})
        self.assertEqual(len(b.graph.nodes), n + 1, "only the part read is converted")

    def test_conv1d_is_a_conv2d_over_one_row(self):
        b, x = builder([1, 4, 16], out=(1, 6, 8))
        w = Const("conv.weight", np.ones([6, 2, 3], np.float32))
        y = ops.TABLE["aten.conv1d.default"](b, {"input": x, "weight": w, "bias": None, "stride": [2], "padding": [1],
                                                 "dilation": [1], "groups": 2})
        self.assertEqual(y.tshape, (1, 6, 8))
        reshape = b.graph.nodes[y.id]
        conv = b.graph.nodes[reshape["inputs"][0]]
        name, attrs = family(conv)
        self.assertEqual((name, attrs["stride"], attrs["padding"], attrs["groups"]), ("Conv", [1, 2], [0, 1], 2))
        self.assertEqual(conv["shape"], [1, 6, 1, 8])
        self.assertEqual(b.graph.weights["conv.weight"].shape, (6, 2, 1, 3))

    def test_elu_and_selu(self):
        b, x = builder([1, 4])
        y = ops.TABLE["aten.elu.default"](b, {"self": x, "alpha": 0.5, "scale": 1, "input_scale": 1})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": {"Elu": {"alpha": 0.5}}})
        # SELU: scale * elu(x, alpha).
        y = ops.TABLE["aten.elu.default"](b, {"self": x, "alpha": 1.6732632423543772, "scale": 1.0507009873554805, "input_scale": 1})
        node = b.graph.nodes[y.id]
        self.assertEqual(node["op"], {"Unary": {"Affine": {"scale": 1.0507009873554805, "shift": 0.0}}})
        self.assertIn("Elu", b.graph.nodes[node["inputs"][0]]["op"]["Unary"])

    def test_softplus_keeps_beta_and_threshold(self):
        b, x = builder([1, 4])
        y = ops.TABLE["aten.softplus.default"](b, {"self": x, "beta": 2, "threshold": 1.5})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": {"Softplus": {"beta": 2.0, "threshold": 1.5}}})
        self.assertEqual(b.graph.nodes[y.id]["path"], "blk.softplus")
        # PyTorch's defaults, when the export leaves them out.
        y = ops.TABLE["aten.softplus.default"](b, {"self": x})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": {"Softplus": {"beta": 1.0, "threshold": 20.0}}})

    def test_fake_quantize_per_tensor_and_per_channel(self):
        b, x = builder([1, 3, 4, 4])
        y = ops.TABLE["aten.fake_quantize_per_tensor_affine.default"](
            b, {"self": x, "scale": 0.02, "zero_point": 10, "quant_min": 0, "quant_max": 255})
        params = {"format": "Int8", "scale": [0.02], "zero_point": [10], "axis": None, "qmin": 0, "qmax": 255}
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Quant": {"FakeQuantize": params}})
        # QAT's FakeQuantize modules pass their scale and zero point as tensors.
        qparams = {"self": x, "scale": Const("fq.scale", np.array([0.5], np.float32)),
                   "zero_point": Const("fq.zero_point", np.array([0], np.int32)), "quant_min": -128, "quant_max": 127}
        y = ops.TABLE["aten.fake_quantize_per_tensor_affine.tensor_qparams"](b, qparams)
        self.assertEqual(b.graph.nodes[y.id]["op"]["Quant"]["FakeQuantize"]["scale"], [0.5])
        scales = Const("fq.scales", np.array([0.5, 0.25, 0.125], np.float32))
        zeros = Const("fq.zeros", np.zeros(3, np.int32))
        y = ops.TABLE["aten.fake_quantize_per_channel_affine.default"](
            b, {"self": x, "scale": scales, "zero_point": zeros, "axis": 1, "quant_min": -128, "quant_max": 127})
        q = b.graph.nodes[y.id]["op"]["Quant"]["FakeQuantize"]
        self.assertEqual((q["scale"], q["zero_point"], q["axis"]), ([0.5, 0.25, 0.125], [0, 0, 0], 1))

    def test_quantisation_parameters_must_be_constant_and_fit(self):
        b, x = builder([1, 3, 4, 4])
        fq = ops.TABLE["aten.fake_quantize_per_tensor_affine.tensor_qparams"]
        with self.assertRaisesRegex(Unsupported, "computed from the input"):
            fq(b, {"self": x, "scale": x, "zero_point": 0, "quant_min": -128, "quant_max": 127})
        with self.assertRaisesRegex(Unsupported, "positive"):
            fq(b, {"self": x, "scale": -0.5, "zero_point": 0, "quant_min": -128, "quant_max": 127})
        with self.assertRaisesRegex(Unsupported, "not 8-bit"):
            fq(b, {"self": x, "scale": 0.5, "zero_point": 0, "quant_min": 0, "quant_max": 65535})
        with self.assertRaisesRegex(Unsupported, "2 scale values for 3 channels"):
            ops.TABLE["aten.fake_quantize_per_channel_affine.default"](
                b, {"self": x, "scale": Const("s", np.ones(2, np.float32)), "zero_point": Const("z", np.zeros(2, np.int32)),
                    "axis": 1, "quant_min": -128, "quant_max": 127})

    def test_relu6_and_hardtanh_are_clamps(self):
        b, x = builder([1, 4])
        y = ops.TABLE["aten.hardtanh.default"](b, {"self": x, "min_val": 0.0, "max_val": 6.0})
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Unary": {"Clamp": {"min": 0.0, "max": 6.0}}})

    def test_a_view_keeping_the_batch_is_a_flatten_or_a_reshape(self):
        b, x = builder([2, 8, 4, 4])
        y = b.reshape(x, (2, 128))
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Shape": {"Flatten": {"start": 1}}})
        z = b.reshape(x, (2, 8, 16))
        self.assertEqual(b.graph.nodes[z.id]["op"], {"Shape": {"Flatten": {"start": 2}}})
        w = b.reshape(x, (2, 4, 2, 16))
        self.assertEqual(b.graph.nodes[w.id]["op"], {"Shape": {"Reshape": {"dims": [4, 2, 16]}}})
        self.assertFalse(w.lifted)

    def test_an_unsqueeze_of_the_last_dim_is_a_reshape_not_a_flatten(self):
        # [1, 3, 4] → [1, 3, 4, 1] (RoPE's `x.unsqueeze(-1)`): no flatten from dim 3 of a 3-D value.
        b, x = builder([1, 3, 4])
        y = b.reshape(x, (1, 3, 4, 1))
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Shape": {"Reshape": {"dims": [3, 4, 1]}}})

    def test_batch_norm_of_tokens_merged_with_the_batch_is_a_per_channel_affine(self):
        # LeViT's BatchNorm1d of `x.flatten(0, 1)`: [B·N, C] rows are tokens of every image.
        b, x = builder([1, 4, 3])
        rows = b.reshape(x, (4, 3))
        self.assertTrue(rows.lifted)
        w, bias = np.array([1.0, 2.0, 0.5], np.float32), np.array([0.0, 1.0, -1.0], np.float32)
        mean, var = np.array([0.5, -0.5, 0.0], np.float32), np.array([1.0, 4.0, 0.25], np.float32)
        y = ops.TABLE["aten._native_batch_norm_legit_no_training.default"](b, {
            "input": rows, "weight": Const("bn.weight", w), "bias": Const("bn.bias", bias), "running_mean": Const("bn.running_mean", mean),
            "running_var": Const("bn.running_var", var), "momentum": 0.1, "eps": 0.0})[0]
        mul, add = b.graph.nodes[-3], b.graph.nodes[-1]
        self.assertEqual((mul["op"], add["op"]), ({"Binary": "Mul"}, {"Binary": "Add"}))
        scale = b.graph.weights[b.graph.nodes[mul["inputs"][1]]["op"]["Weight"]["name"]]
        shift = b.graph.weights[b.graph.nodes[add["inputs"][1]]["op"]["Weight"]["name"]]
        np.testing.assert_allclose(scale, w / np.sqrt(var))
        np.testing.assert_allclose(shift, bias - mean * w / np.sqrt(var))
        self.assertEqual((y.lifted, y.tshape), (True, (4, 3)))

    def test_merging_the_batch_lifts_the_value_and_unmerging_drops_the_lift(self):
        # Swin: [1, 56, 56, 96] → [64 windows, 49, 96] → back to [1, 56, 56, 96].
        b, x = builder([1, 8, 8, 4])
        windows = b.reshape(x, (4, 16, 4))
        self.assertTrue(windows.lifted)
        self.assertEqual(windows.kshape, [1, 4, 16, 4])
        self.assertEqual(b.graph.nodes[windows.id]["shape"], [1, 4, 16, 4])
        back = b.reshape(windows, (1, 8, 8, 4))
        self.assertFalse(back.lifted)
        self.assertEqual(b.graph.nodes[back.id]["op"], {"Shape": {"Reshape": {"dims": [8, 8, 4]}}})

    def test_a_permute_moving_dim_0_is_made_on_the_lifted_value(self):
        b, x = builder([1, 5, 6])
        y = b.permute(x, [1, 0, 2])
        self.assertTrue(y.lifted)
        self.assertEqual(b.graph.nodes[y.id]["op"], {"Shape": {"Permute": {"dims": [0, 2, 1, 3]}}})
        self.assertEqual(y.kshape, [1, 5, 1, 6])

    def test_lifting_needs_the_batch_in_dim_0(self):
        # At batch 1 a value [2, 5, 6] holds something else than the batch in dim 0.
        b, x = builder([2, 5, 6])
        with self.assertRaisesRegex(Unsupported, "moves or merges dim 0"):
            b.permute(x, [1, 0, 2])

    def test_a_strided_slice_is_a_view_and_a_narrow(self):
        # x[:, ::2] of [1, 6, 3]: view as [1, 3, 2, 3], keep index 0 of the step axis, merge it away.
        b, x = builder([1, 6, 3])
        y = b.slice(x, 1, 0, 6, 2)
        self.assertEqual(y.tshape, (1, 3, 3))
        kinds = [family(n)[1] for n in b.graph.nodes[1:]]
        self.assertEqual(kinds[0], {"Reshape": {"dims": [3, 2, 3]}})
        self.assertEqual(kinds[1], {"Slice": {"dim": 2, "start": 0, "len": 1}})
        self.assertEqual(kinds[2], {"Flatten": {"start": 2}}, "[1, 3, 1, 3] → [1, 3, 3]")
        # An end that is not a whole number of steps away pads first: x[:, 1::2] of [1, 5, 3].
        b, x = builder([1, 5, 3])
        y = b.slice(x, 1, 1, 5, 2)
        self.assertEqual(y.tshape, (1, 2, 3))

    def test_cat_with_a_constant_is_a_pad_and_an_add(self):
        # ViT: cat([class_token [1, 1, 4], x [1, 3, 4]], 1).
        b, x = builder([1, 3, 4], out=(1, 4, 4))
        token = Const("class_token", np.arange(4, dtype=np.float32).reshape(1, 1, 4))
        y = ops.TABLE["aten.cat.default"](b, {"tensors": [token, x], "dim": 1})
        add = b.graph.nodes[y.id]
        self.assertEqual(add["op"], {"Binary": "Add"})
        pad = b.graph.nodes[add["inputs"][0]]
        self.assertEqual(pad["op"], {"Shape": {"Pad": {"pads": [0, 0, 1, 0], "value": 0.0}}})
        name = b.graph.nodes[add["inputs"][1]]["op"]["Weight"]["name"]
        full = b.graph.weights[name]
        self.assertEqual(full.shape, (1, 4, 4))
        np.testing.assert_array_equal(full[0, 0], [0, 1, 2, 3])
        np.testing.assert_array_equal(full[0, 1:], 0)

    def test_a_constant_added_after_a_cat_with_constants_is_merged_into_one_add(self):
        from kiln_torch.convert import merge_constant_adds

        b, x = builder([1, 3, 4], out=(1, 4, 4))
        token = Const("class_token", np.ones([1, 1, 4], np.float32))
        y = ops.TABLE["aten.cat.default"](b, {"tensors": [token, x], "dim": 1})
        b.begin("aten.add.Tensor", "add", "encoder", False, (1, 4, 4))
        pos = Const("encoder.pos_embedding", np.full([1, 4, 4], 2.0, np.float32))
        z = ops.TABLE["aten.add.Tensor"](b, {"self": y, "other": pos, "alpha": 1})
        b.graph.mark_output("out", z.id)
        merge_constant_adds(b.graph, b.cat_constant_adds)
        adds = [n for n in b.graph.nodes if n["op"] == {"Binary": "Add"}]
        self.assertEqual(len(adds), 1)
        merged = b.graph.weights["encoder.pos_embedding+blk.node.cat_constants"]
        np.testing.assert_array_equal(merged[0, 0], [3, 3, 3, 3])
        np.testing.assert_array_equal(merged[0, 1:], 2)
        self.assertNotIn("blk.node.cat_constants", b.graph.weights, "the unused constant is dropped")
        self.assertEqual(b.graph.nodes[b.graph.outputs[0][1]]["path"], "encoder.add")

    def test_split_slices_only_the_parts_that_are_read(self):
        b, x = builder([1, 6, 2, 2])
        parts = ops.TABLE["aten.split.Tensor"](b, {"self": x, "split_size": 3, "dim": 1})
        self.assertEqual(len(b.graph.nodes), 1)
        second = parts[1]()
        self.assertEqual(b.graph.nodes[second.id]["op"], {"Shape": {"Slice": {"dim": 1, "start": 3, "len": 3}}})
        self.assertEqual(len(b.graph.nodes), 2)

    def test_a_conv_of_windows_cannot_unmerge_the_batch(self):
        b, x = builder([1, 8, 8, 4])
        windows = b.reshape(x, (4, 16, 4))
        with self.assertRaisesRegex(Unsupported, "batch merged"):
            b.unlift(windows)

    def test_a_conv_of_rows_merged_with_the_batch_is_one_grouped_conv(self):
        # EfficientViT-M: a conv per window of [B·4, 2, 3, 3] at batch 2, Kiln's [2, 4, 2, 3, 3].
        b = Builder()
        b.batch = 2
        x = Act(b.graph.input("x", (2, 4, 2, 3, 3)), (2, 4, 2, 3, 3))
        rows = b.reshape(x, (8, 2, 3, 3))
        self.assertEqual((rows.lifted, rows.kshape), (True, [2, 4, 2, 3, 3]))
        rng = np.random.default_rng(0)
        w, bias = rng.standard_normal((5, 2, 3, 3)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
        b.begin("aten.convolution.default", "conv", "attn.conv", True, (8, 5, 3, 3))
        y = ops.TABLE["aten.convolution.default"](b, {
            "input": rows, "weight": Const("attn.conv.weight", w), "bias": Const("attn.conv.bias", bias), "stride": [1, 1],
            "padding": [1, 1], "dilation": [1, 1], "transposed": False, "output_padding": [0, 0], "groups": 1})
        self.assertEqual((y.lifted, y.tshape, y.kshape), (True, (8, 5, 3, 3), [2, 4, 5, 3, 3]))
        flat, conv, back = b.graph.nodes[-5], b.graph.nodes[-2], b.graph.nodes[-1]
        self.assertEqual(flat["op"], {"Shape": {"Reshape": {"dims": [8, 3, 3]}}})
        self.assertEqual((conv["op"]["Conv"]["groups"], conv["path"], conv["shape"]), (4, "attn.conv", [2, 20, 3, 3]))
        self.assertEqual(back["op"], {"Shape": {"Reshape": {"dims": [4, 5, 3, 3]}}})
        tiled = b.graph.weights["attn.conv.weight.repeated_4"]
        self.assertEqual(tiled.shape, (20, 2, 3, 3))
        # The grouped conv of the rows side by side is each row's conv.
        image = rng.standard_normal((4, 2, 3, 3)).astype(np.float32)
        padded = np.pad(image.reshape(8, 3, 3), ((0, 0), (1, 1), (1, 1)))
        grouped = np.stack([
            (padded[2 * (o // 5) : 2 * (o // 5) + 2, i : i + 3, j : j + 3] * tiled[o]).sum()
            for o in range(20) for i in range(3) for j in range(3)]).reshape(20, 3, 3)
        grouped += np.tile(bias, 4)[:, None, None]
        padded_rows = np.pad(image, ((0, 0), (0, 0), (1, 1), (1, 1)))
        per_row = np.stack([[[[(padded_rows[r, :, i : i + 3, j : j + 3] * w[o]).sum() + bias[o] for j in range(3)] for i in range(3)]
                             for o in range(5)] for r in range(4)])
        np.testing.assert_allclose(grouped.reshape(4, 5, 3, 3), per_row, rtol=1e-5, atol=1e-5)

    def test_bicubic_interpolation_is_two_matmuls_with_pytorchs_weights(self):
        # The first rows of a 4 → 8 bicubic resize, as PyTorch 2.15 gives them (the taps clamped at the border).
        m = ops.bicubic_matrix(4, 8, align_corners=False)
        np.testing.assert_allclose(m[:2], [[1.10546875, -0.10546875, 0, 0], [0.7734375, 0.26171875, -0.03515625, 0]], atol=1e-12)
        np.testing.assert_allclose(m.sum(1), np.ones(8), atol=1e-12)
        np.testing.assert_allclose(ops.bicubic_matrix(5, 5, False), np.eye(5), atol=1e-12)
        ramp = ops.bicubic_matrix(6, 11, align_corners=True) @ np.arange(6.0)
        np.testing.assert_allclose(ramp[2:-2], np.arange(11.0)[2:-2] / 2, atol=1e-12, err_msg="cubic keeps a ramp")
        b, x = builder([1, 3, 4, 6], out=(1, 3, 8, 12))
        y = ops.TABLE["aten.upsample_bicubic2d.vec"](b, {"input": x, "output_size": [8, 12], "align_corners": False,
                                                         "scale_factors": None})
        self.assertEqual(y.tshape, (1, 3, 8, 12))
        kinds = [n["op"] for n in b.graph.nodes if "Weight" not in n["op"] and "Input" not in n["op"]]
        self.assertEqual(kinds, [{"Gemm": "Matmul"}, {"Shape": {"Permute": {"dims": [0, 1, 3, 2]}}}, {"Gemm": "Matmul"},
                                 {"Shape": {"Permute": {"dims": [0, 1, 3, 2]}}}])
        self.assertEqual(b.graph.weights["blk.node.bicubic_w"].shape, (6, 12))

    def test_unsupported_arguments_say_why(self):
        b, x = builder([1, 3, 8, 8])
        with self.assertRaisesRegex(Unsupported, "padding mode 'circular'"):
            ops.TABLE["aten.pad.default"](b, {"self": x, "pad": [1, 1, 1, 1], "mode": "circular", "value": None})
        with self.assertRaisesRegex(Unsupported, "computed weight"):
            ops.TABLE["aten.linear.default"](b, {"input": x, "weight": x, "bias": None})

    def test_deform_conv2d_maps_to_the_plugin_op(self):
        b, x = builder([1, 4, 8, 8], out=(1, 4, 8, 8))
        offset = Act(b.graph.input("offset", [1, 18, 8, 8]), (1, 18, 8, 8))
        w = Const("dcn.weight", np.zeros([4, 4, 3, 3], np.float32))
        zero_bias = Const("dcn.bias_zeros", np.zeros([4], np.float32))
        a = {"input": x, "weight": w, "offset": offset, "mask": Const("m", np.zeros([1], np.float32)), "bias": zero_bias,
             "stride_h": 1, "stride_w": 1, "pad_h": 1, "pad_w": 1, "dilation_h": 1, "dilation_w": 1, "groups": 1,
             "offset_groups": 1, "use_mask": False}
        y = ops.TABLE["torchvision.deform_conv2d.default"](b, a)
        node = b.graph.nodes[y.id]
        self.assertEqual(node["op"]["Custom"]["name"], "deform_conv2d")
        self.assertEqual(node["op"]["Custom"]["attrs"]["bias"], 0.0, "a zero bias is no bias")
        self.assertEqual(len(node["inputs"]), 3, "x, offset, weight")

    def test_a_custom_op_takes_tensors_as_inputs_and_numbers_as_attributes(self):
        b, x = builder([1, 4])
        w = Const("scale", np.ones([4], np.float32))
        y = ops.CustomOp("scaled_swish")(b, {"self": x, "scale": w, "beta": 1.5, "dims": [1, 2], "flag": True})
        node = b.graph.nodes[y.id]
        self.assertEqual(node["op"], {"Custom": {"name": "scaled_swish", "attrs": {"beta": 1.5, "dims_0": 1.0, "dims_1": 2.0,
                                                                                   "flag": 1.0}}})
        self.assertEqual(b.graph.nodes[node["inputs"][1]]["op"], {"Weight": {"name": "scale"}})


class Modules(unittest.TestCase):
    def test_multihead_self_attention_is_in_proj_qkv_attention_out_proj(self):
        b, x = builder([1, 5, 8], scope="encoder.layers.0.self_attention", out=(1, 5, 8))
        params = {
            "in_proj_weight": Const("sa.in_proj_weight", np.zeros([24, 8], np.float32)),
            "in_proj_bias": Const("sa.in_proj_bias", np.zeros([24], np.float32)),
            "out_proj.weight": Const("sa.out_proj.weight", np.zeros([8, 8], np.float32)),
            "out_proj.bias": Const("sa.out_proj.bias", np.zeros([8], np.float32)),
        }
        attrs = {"num_heads": 2, "embed_dim": 8, "batch_first": True, "qkv_same_embed_dim": True}
        (y,) = ops.MODULES["torch.nn.modules.activation.MultiheadAttention"](b, attrs, [x], params)
        nodes = [n for n in b.graph.nodes if family(n)[0] not in ("Input", "Weight")]
        self.assertEqual([n["path"].rsplit(".", 1)[1] for n in nodes], ["in_proj", "qkv_attention", "out_proj"])
        self.assertEqual(nodes[1]["op"], {"QkvAttention": {"heads": 2, "scale": 0.5, "bias": False}})
        self.assertEqual(nodes[0]["shape"], [1, 5, 24])
        self.assertEqual(b.graph.nodes[y.id]["shape"], [1, 5, 8])
        with self.assertRaises(Unsupported):
            ops.MODULES["torch.nn.modules.activation.MultiheadAttention"](b, dict(attrs, batch_first=False), [x], params)

    def test_torchvisions_layer_norm2d_is_one_layer_norm_over_the_channels(self):
        b, x = builder([1, 4, 3, 3], scope="features.0.1", leaf=True)
        params = {"weight": Const("features.0.1.weight", np.ones([4], np.float32)),
                  "bias": Const("features.0.1.bias", np.zeros([4], np.float32))}
        (y,) = ops.MODULES["torchvision.models.convnext.LayerNorm2d"](b, {"normalized_shape": (4,), "eps": 1e-6}, [x], params)
        node = b.graph.nodes[y.id]
        self.assertEqual(node["op"], {"Norm": {"LayerNorm": {"dim": 1, "shape": [4], "eps": 1e-6, "affine": True}}})
        self.assertEqual(node["path"], "features.0.1")

    def test_the_shifted_window_mask_separates_the_rolled_regions(self):
        # A 4x4 map, windows of 2, shift 1: slicing assignment as torchvision builds it.
        ph = pw = 4
        w, s = 2, 1
        img = np.zeros((ph, pw))
        count = 0
        for hs in (slice(0, -w), slice(-w, -s), slice(-s, None)):
            for ws in (slice(0, -w), slice(-w, -s), slice(-s, None)):
                img[hs, ws] = count
                count += 1
        win = img.reshape(2, w, 2, w).transpose(0, 2, 1, 3).reshape(4, w * w)
        want = np.where(win[:, None, :] != win[:, :, None], -100.0, 0.0)
        np.testing.assert_array_equal(ops.shifted_window_mask(ph, pw, w, s), want)
        self.assertEqual(ops.shifted_window_mask(ph, pw, w, s)[0].sum(), 0, "the top-left window is one region")

    def test_swin_window_attention_is_one_packed_attention_with_a_constant_bias(self):
        b, x = builder([1, 4, 4, 8], scope="features.1.1.attn", out=(1, 4, 4, 8))
        params = {"qkv.weight": Const("q.w", np.zeros([24, 8], np.float32)), "qkv.bias": Const("q.b", np.zeros([24], np.float32)),
                  "proj.weight": Const("p.w", np.zeros([8, 8], np.float32)), "proj.bias": Const("p.b", np.zeros([8], np.float32))}
        attrs = {"window_size": [2, 2], "shift_size": [1, 1], "num_heads": 2, "relative_position_bias": np.zeros([1, 2, 4, 4])}
        (y,) = ops.MODULES["torchvision.models.swin_transformer.ShiftedWindowAttention"](b, attrs, [x], params)
        kinds = [family(n)[0] for n in b.graph.nodes if family(n)[0] not in ("Input", "Weight")]
        self.assertEqual(kinds.count("QkvAttention"), 1)
        att = next(n for n in b.graph.nodes if family(n)[0] == "QkvAttention")
        bias = b.graph.nodes[att["inputs"][1]]
        self.assertEqual(bias["shape"], [4, 2, 4, 4], "[windows, heads, N, N]")
        self.assertEqual(b.graph.nodes[y.id]["shape"], [1, 4, 4, 8])
        self.assertFalse(any(n["shape"][0] != 1 for n in b.graph.nodes if family(n)[0] not in ("Weight",)), "the batch stays in front")


if __name__ == "__main__":
    unittest.main()
