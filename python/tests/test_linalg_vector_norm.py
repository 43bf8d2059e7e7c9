"""`aten.linalg_vector_norm` (ConvNeXt-V2's Global Response Norm: `torch.norm(x, p=2, dim=(1, 2),
keepdim=True)` on NHWC) from Kiln's reductions, without torch: the converter's Kiln graph, run by
the NumPy model of Kiln's ops, against NumPy's `linalg.norm`."""

import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from test_any_batch import call, run_kiln  # noqa: E402

from kiln_torch.convert import Builder  # noqa: E402
from kiln_torch.graph import Act  # noqa: E402
from kiln_torch.ops import Unsupported  # noqa: E402


def norm_graph(shape, out, mark=True, **args):
    b = Builder()
    b.batch = shape[0]
    x = Act(b.graph.input("x", shape), shape)
    y = call(b, "aten.linalg_vector_norm.default", out, self=x, **args)
    if mark:
        b.graph.mark_output("output", b.unlift(y).id)
    return b.graph


class VectorNorm(unittest.TestCase):
    def test_each_order_matches_numpy(self):
        x = np.random.default_rng(1).uniform(-2, 2, (2, 3, 4, 5)).astype(np.float32)
        cases = [
            ({"ord": 2, "dim": [1, 2], "keepdim": True}, (2, 1, 1, 5), lambda v: np.sqrt((v.astype(np.float64) ** 2).sum((1, 2), keepdims=True))),
            ({"ord": 1, "dim": [-1], "keepdim": False}, (2, 3, 4), lambda v: np.abs(v).sum(-1)),
            ({"ord": float("inf"), "dim": [3], "keepdim": False}, (2, 3, 4), lambda v: np.abs(v).max(-1)),
            ({"ord": 3, "dim": [2, 3], "keepdim": False}, (2, 3), lambda v: (np.abs(v.astype(np.float64)) ** 3).sum((2, 3)) ** (1 / 3)),
        ]
        for args, out, want in cases:
            g = norm_graph(x.shape, out, **args)
            got = run_kiln(g.to_json(), g.weights, {"x": x})["output"]
            np.testing.assert_allclose(got, want(x), rtol=1e-5, err_msg=str(args))
            # Exported at batch 2, it runs at batch 3.
            x3 = np.concatenate([x, x[:1]])
            np.testing.assert_allclose(run_kiln(g.to_json(), g.weights, {"x": x3})["output"], want(x3), rtol=1e-5)

    def test_the_default_is_the_2_norm_of_everything_and_other_orders_are_reported(self):
        g = norm_graph((1, 6), (), mark=False, dim=None, keepdim=False)
        self.assertEqual([n["op"] for n in g.nodes[-2:]], [{"Unary": {"Affine": {"scale": 6.0, "shift": 0.0}}}, {"Unary": "Sqrt"}])
        self.assertEqual(g.nodes[-3]["op"], {"Pool": {"Mean": {"dims": [1, 2], "keepdim": False}}}, "every dim, lifted at batch 1")
        for order in (0, -1, float("-inf")):
            with self.assertRaisesRegex(Unsupported, "vector norm of ord"):
                norm_graph((1, 6), (1,), ord=order, dim=[1], keepdim=False)


if __name__ == "__main__":
    unittest.main()
