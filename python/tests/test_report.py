"""The report of unsupported nodes and the graph file format, without torch."""

import json
import os
import struct
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kiln_torch import graph as kg  # noqa: E402
from kiln_torch.report import Missing, UnsupportedOpsError, format_report, source_line  # noqa: E402

TRACE = """File "/home/u/mynet.py", line 31, in forward
    x = self.block(x)
  File "/usr/lib/python3/site-packages/torch/nn/modules/module.py", line 1775, in _call_impl
    return forward_call(*args, **kwargs)
  File "/home/u/mynet.py", line 12, in forward
    return torch.erf(x) * x
  File "/usr/lib/python3/site-packages/torch/_ops.py", line 840, in __call__
    return self._op(*args)"""


class Report(unittest.TestCase):
    def test_every_node_is_listed_with_its_op_path_class_and_source_line(self):
        missing = [
            Missing("aten.erf.default", "blocks.0", "mynet.ErfBlock", "mynet.py:12 in forward: return torch.erf(x) * x", "Kiln has no such op"),
            Missing("aten.erf.default", "blocks.1", "mynet.ErfBlock", None, "Kiln has no such op"),
            Missing("aten.pad.default", "head", "mynet.Head", None, "padding mode 'reflect' (Kiln pads with a constant)"),
        ]
        text = format_report(missing, "MyNet")
        self.assertIn("3 nodes of MyNet cannot be imported (2 ops); nothing was written.", text)
        self.assertIn("  aten.erf.default  (2 nodes)\n    at blocks.0 (mynet.ErfBlock): Kiln has no such op\n"
                      "      mynet.py:12 in forward: return torch.erf(x) * x\n    at blocks.1 (mynet.ErfBlock)", text)
        self.assertIn("  aten.pad.default  (1 node)\n    at head (mynet.Head): padding mode 'reflect'", text)
        self.assertIn('custom_ops={"aten.erf.default": "erf", "aten.pad.default": "pad"}', text)
        self.assertIn("--custom-op aten.erf.default=erf --custom-op aten.pad.default=pad", text)
        self.assertIn("torch.library.custom_op", text)
        self.assertIn('docs/IMPORT.md, "Import a model with an op Kiln lacks"', text)

    def test_the_error_carries_the_nodes_and_prints_the_report(self):
        e = UnsupportedOpsError([Missing("aten.erf.default", "", "m.Net", None, "Kiln has no such op")], "Net")
        self.assertEqual(len(e.missing), 1)
        self.assertIn("at <model> (m.Net)", str(e))

    def test_the_source_line_is_the_innermost_frame_outside_torch(self):
        self.assertEqual(source_line(TRACE), "u/mynet.py:12 in forward: return torch.erf(x) * x")
        self.assertIsNone(source_line(None))
        self.assertIsNone(source_line("no frames here"))


class GraphFile(unittest.TestCase):
    def test_the_file_is_safetensors_with_the_graph_json_in_its_metadata(self):
        g = kg.KilnGraph()
        x = g.input("input", [1, 3, 4, 4])
        w = g.weight("conv.weight", np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2))
        self.assertEqual(g.weight("conv.weight", np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2)), w, "one node per name")
        y = g.push({"Conv": {}}, [x, w], [1, 2, 3, 3], "conv")
        g.mark_output("out", y)
        g.modules[""] = "m.Net"
        data = kg.encode(g, {"model": "net"})
        (n,) = struct.unpack("<Q", data[:8])
        self.assertEqual((8 + n) % 8, 0, "data starts 8-byte aligned")
        tensors, meta = kg.decode_safetensors(data)
        self.assertEqual(meta["format"], "kiln-graph")
        self.assertEqual(meta["kiln.version"], "1")
        self.assertEqual(meta["model"], "net")
        np.testing.assert_array_equal(tensors["conv.weight"], np.arange(24).reshape(2, 3, 2, 2))
        graph = json.loads(meta["kiln.graph"])
        self.assertEqual(graph["inputs"], [0])
        self.assertEqual(graph["outputs"], [["out", 2]])
        self.assertEqual(graph["nodes"][1], {"op": {"Weight": {"name": "conv.weight"}}, "inputs": [], "shape": [2, 3, 2, 2],
                                             "dtype": "F32", "path": "conv.weight"})
        self.assertEqual(graph["modules"], {"": "m.Net"})

    def test_mistakes_are_caught_while_building(self):
        g = kg.KilnGraph()
        g.input("input", [1])
        with self.assertRaises(ValueError):
            g.input("input", [1])
        with self.assertRaises(ValueError):
            g.push({"Unary": "Relu"}, [5], [1], "relu")
        g.weight("w", np.zeros([2], np.float32))
        with self.assertRaises(ValueError):
            g.weight("w", np.ones([2], np.float32))

    def test_op_names_are_short(self):
        self.assertEqual(kg.op_name({"Unary": "Relu"}), "Unary.Relu")
        self.assertEqual(kg.op_name({"Shape": {"Reshape": {"dims": [2]}}}), "Shape.Reshape")
        self.assertEqual(kg.op_name({"Conv": {"stride": [1, 1]}}), "Conv")
        self.assertEqual(kg.op_name({"Custom": {"name": "deform_conv2d", "attrs": {}}}), "Custom.deform_conv2d")


if __name__ == "__main__":
    unittest.main()
