"""Issue 42's first contact, on the pure-Python side (no torch): exports never download, the report
lists every unsupported node, references store inputs by name, random weights are marked."""

import os
import socket
import sys
import unittest
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kiln_torch import builders  # noqa: E402
from kiln_torch import cli  # noqa: E402
from kiln_torch import graph as kg  # noqa: E402
from kiln_torch.convert import Unknown, plan  # noqa: E402
from kiln_torch.graph import Act, Const  # noqa: E402
from kiln_torch.report import Missing, format_report  # noqa: E402


def deeplabv3_resnet50(*, weights=None, progress=True, num_classes=None, aux_loss=None, weights_backbone="IMAGENET1K_V1", **kwargs):
    """torchvision's segmentation builders' signature: the backbone's weights download by default."""
    return {"weights": weights, "weights_backbone": weights_backbone, **kwargs}


def create_model(model_name, pretrained=True, **kwargs):
    """timm's `create_model` signature."""
    return {"name": model_name, "pretrained": pretrained, **kwargs}


class Unet:
    """segmentation_models_pytorch's signature."""

    def __init__(self, encoder_name="resnet34", encoder_weights="imagenet", classes=1):
        self.encoder_weights = encoder_weights


def fetches(url):
    def builder():
        return urllib.request.urlopen(url, timeout=1)

    return builder


class NoDownloads(unittest.TestCase):
    def test_every_weight_argument_a_builder_takes_is_set_to_fetch_nothing(self):
        self.assertEqual(builders.build(deeplabv3_resnet50, {}, "torchvision.models.segmentation"),
                         {"weights": None, "weights_backbone": None})
        self.assertEqual(builders.build(create_model, {"model_name": "convnextv2_atto"}, "timm"),
                         {"name": "convnextv2_atto", "pretrained": False})
        self.assertIsNone(builders.build(Unet, {}, "segmentation_models_pytorch").encoder_weights)

    def test_what_the_user_gives_is_kept_and_nothing_is_passed_that_the_builder_lacks(self):
        self.assertEqual(builders.no_download_kwargs(deeplabv3_resnet50, {"weights_backbone": "mine"}, "torchvision.models")["weights_backbone"], "mine")

        def plain(**kwargs):
            return kwargs

        self.assertEqual(builders.no_download_kwargs(plain, {}, "mylib"), {}, "an unknown **kwargs builder gets nothing added")
        self.assertEqual(builders.no_download_kwargs(plain, {}, "torchvision.models"), {"weights": None})

    def test_an_attempted_download_is_a_clear_error_naming_the_address(self):
        real = socket.socket.connect
        with self.assertRaises(builders.DownloadError) as caught:
            builders.build(fetches("http://127.0.0.1:9/resnet50.pth"), {}, what="mynet:build")
        text = str(caught.exception)
        self.assertIn("mynet:build tried to download", text)
        self.assertIn("127.0.0.1", text)
        self.assertIn("--weights", text)
        self.assertIs(socket.socket.connect, real, "the real connect is back")

    def test_a_builder_that_swallows_the_refusal_and_raises_its_own_error_is_still_a_download_error(self):
        def hub_like():
            try:
                urllib.request.urlopen("http://127.0.0.1:9/model.safetensors", timeout=1)
            except OSError:
                raise RuntimeError("could not reach the hub") from None

        with self.assertRaises(builders.DownloadError) as caught:
            builders.build(hub_like, {})
        self.assertIn("could not reach the hub", str(caught.exception))

    def test_other_failures_pass_unchanged(self):
        def broken():
            raise KeyError("depth")

        with self.assertRaises(KeyError):
            builders.build(broken, {})


class EveryUnsupportedNode(unittest.TestCase):
    def test_a_node_without_a_kiln_op_is_reported_even_downstream_of_another(self):
        act, unknown, const = Act(0, (1, 4)), Unknown((1, 4)), Const("w", np.zeros([4], np.float32))
        convert = object()
        # grid_sample, then cumsum of its result: both are missing.
        self.assertEqual(plan([act], None), "missing")
        self.assertEqual(plan([unknown], None), "missing")
        self.assertEqual(plan([unknown, 1], None), "missing")
        # A supported op downstream is skipped: the node upstream is in the report.
        self.assertEqual(plan([unknown, act], convert), "skip")
        self.assertEqual(plan([act, const], convert), "convert")
        self.assertEqual(plan([const, 2], None), "fold", "constants are computed by PyTorch, whatever the op")
        self.assertEqual(plan([act], convert, has_schema=False), "missing")

    def test_the_report_names_public_paths(self):
        text = format_report([Missing("aten.cumsum.default", "head", "m.Head", None, "Kiln has no such op")], "Net")
        self.assertIn("kiln::plugin::CustomOp", text)
        self.assertNotIn("kiln::ops::", text)


class Reference(unittest.TestCase):
    def test_inputs_are_stored_by_name_whatever_they_are_called(self):
        x, y = np.ones([2, 3], np.float32), np.zeros([2, 5], np.float32)
        tensors, meta = kg.decode_safetensors(kg.encode_reference({"x": x, "mask": y}, {"out": x * 2}, {"model": "Net"}))
        self.assertEqual(sorted(tensors), ["input.mask", "input.x", "output.out"])
        np.testing.assert_array_equal(tensors["input.x"], x)
        self.assertEqual(meta, {"model": "Net"})
        one, _ = kg.decode_safetensors(kg.encode_reference({"x": x}, {"output": x}))
        self.assertEqual(sorted(one), ["input.x", "output.output"], "one input is named too")


class RandomWeights(unittest.TestCase):
    def test_a_graph_without_weights_is_marked_random(self):
        self.assertEqual(cli.weights_metadata(None, 3), {"weights": "random (torch init, seed 3)", "kiln.random_weights": "true"})
        self.assertEqual(cli.weights_metadata("rn50.safetensors", 0), {"weights": "rn50.safetensors"})


if __name__ == "__main__":
    unittest.main()
