"""Kiln's seeded weight generator in NumPy, bit-identical to `src/seeded.rs`.

Element `i` of the tensor named `name` is `u = mix(fnv1a64(name) + (i + 1) * PHI) >> 11` scaled to
[0, 1) (splitmix64's finaliser), then shaped by the name's last segment (see the table in
`src/seeded.rs`). Every step is integer arithmetic on uint64 (which wraps, as Rust's `wrapping_*`)
or one f64 expression evaluated in the same order as the Rust code, rounded to f32 once.
"""

import math

import numpy as np

MASK = (1 << 64) - 1
PHI = np.uint64(0x9E3779B97F4A7C15)


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


def mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (multiplications wrap)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def uniform(seed: int, n: int) -> np.ndarray:
    """The first `n` draws in [0, 1) of the stream `seed`, as float64."""
    i = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = mix(np.uint64(seed) + i * PHI)
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def weight(name: str, shape) -> np.ndarray:
    """The seeded value of the tensor `name` with `shape`, as float32."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    u = uniform(fnv1a64(name.encode()), numel)
    last = name.rsplit(".", 1)[-1]
    if last == "running_var":
        v = 0.5 + u
    elif last == "running_mean":
        v = 0.2 * (2.0 * u - 1.0)
    elif last in ("bias", "in_proj_bias"):
        v = 0.1 * (2.0 * u - 1.0)
    elif last == "weight" and len(shape) == 1:
        v = 0.75 + 0.5 * u
    elif last in ("weight", "in_proj_weight"):
        fan_in = numel // max(shape[0], 1)
        v = (2.0 * u - 1.0) * math.sqrt(3.0 / fan_in)
    else:
        v = 2.0 * u - 1.0
    return v.astype(np.float32).reshape(shape)
