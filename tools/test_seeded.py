#!/usr/bin/env python3
"""Golden values of the seeded weight generator (NumPy side). `tests/seeded.rs` asserts the same
literals against `src/seeded.rs`, so the two implementations cannot drift apart. Run:
`python3 tools/test_seeded.py` (NumPy only)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import seeded  # noqa: E402

# (name, shape, flat index, f32 bit pattern, value): one per row of the scaling table.
GOLDEN = [
    ("conv1.weight", (64, 3, 7, 7), 0, 0x3C53009E, 0.01287856511771679),
    ("conv1.weight", (64, 3, 7, 7), 9407, 0xBDAFB286, -0.08578972518444061),
    ("layer1.0.bn1.running_var", (64,), 5, 0x3F86EE6F, 1.0541514158248901),
    ("layer1.0.bn1.running_mean", (64,), 17, 0x3CA115DB, 0.019663741812109947),
    ("layer1.0.bn1.weight", (64,), 0, 0x3F506152, 0.8139849901199341),
    ("fc.bias", (1000,), 999, 0xBD09B40A, -0.03361896425485611),
    ("fc.weight", (1000, 2048), 1025234, 0xBCC61D77, -0.02418397180736065),
    ("input.0", (1, 3, 224, 224), 150404, 0xBF1D860E, -0.6153267621994019),
]


def test_primitives():
    # Published reference values: FNV-1a 64 of "" and "a", splitmix64's first output from state 0.
    assert seeded.fnv1a64(b"") == 0xCBF29CE484222325
    assert seeded.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert int(seeded.mix(np.array([0x9E3779B97F4A7C15], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    u = seeded.uniform(seeded.fnv1a64(b"conv1.weight"), 3)
    assert u.tolist() == [0.5450749789171447, 0.745161751328336, 0.022921737033572143], u.tolist()


def test_golden():
    for name, shape, flat, bits, value in GOLDEN:
        w = seeded.weight(name, shape)
        assert w.dtype == np.float32 and w.shape == shape, (name, w.dtype, w.shape)
        got = w.reshape(-1)[flat]
        assert int(got.view(np.uint32)) == bits, f"{name}[{flat}] = {got!r} ({int(got.view(np.uint32)):#x}), expected {bits:#x}"
        assert float(got) == value, (name, float(got), value)


def test_ranges():
    # The table's ranges hold over whole tensors, not just the sampled elements.
    var = seeded.weight("x.running_var", (4096,))
    assert var.min() >= 0.5 and var.max() < 1.5
    gamma = seeded.weight("x.weight", (4096,))
    assert gamma.min() >= 0.75 and gamma.max() < 1.25
    w = seeded.weight("x.weight", (64, 64, 3, 3))
    bound = np.float32(np.sqrt(3.0 / (64 * 9)))
    assert np.abs(w).max() <= bound and abs(float(w.mean())) < 0.01 * bound
    # Same name, different shape: a prefix of the same stream.
    assert np.array_equal(seeded.weight("input.0", (10,)), seeded.weight("input.0", (20,))[:10])


if __name__ == "__main__":
    for test in [test_primitives, test_golden, test_ranges]:
        test()
        print(f"{test.__name__}: ok")
