//! The seeded weight generator: tiny, deterministic, and implemented identically in
//! `tools/export_reference.py`, so fixtures need no weight files.
//!
//! Element `i` of the tensor named `name` is `u = mix(fnv1a64(name) + (i + 1) · φ) >> 11` scaled to
//! [0, 1) (splitmix64's finaliser; φ = 0x9E3779B97F4A7C15), then shaped by the name's last segment
//! so activations stay O(1) through a deep network and BatchNorm gets varied statistics:
//!
//! | key ends in                  | value                                   |
//! |------------------------------|-----------------------------------------|
//! | `running_var`                | 0.5 + u                                 |
//! | `running_mean`               | 0.2 · (2u − 1)                          |
//! | `bias`, `in_proj_bias`       | 0.1 · (2u − 1)                          |
//! | `weight`, 1-D (norm gamma)   | 0.75 + 0.5 u                            |
//! | `weight`, ≥ 2-D; `in_proj_weight` (`nn.MultiheadAttention`) | (2u − 1) · √(3 / fan_in), fan_in = numel / shape\[0\] |
//! | anything else (inputs)       | 2u − 1                                  |
//!
//! All arithmetic is in f64 and rounded to f32 once, so Rust and NumPy agree bit for bit.
//! With this table activations stay O(1) through every layer: the largest |activation| is about 13
//! in ResNet-50 and 15 in CenterNet-R50, far from FP16's limit (`tools/export_reference.py --stats`);
//! `tests/seeded.rs` and `tools/test_seeded.py` pin the same golden values.

use crate::host_tensor::{numel, HostTensor};

const PHI: u64 = 0x9E37_79B9_7F4A_7C15;

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The i-th uniform draw in [0, 1) of the stream named `name`.
pub fn uniform(seed: u64, i: u64) -> f64 {
    (mix(seed.wrapping_add((i + 1).wrapping_mul(PHI))) >> 11) as f64 / (1u64 << 53) as f64
}

impl HostTensor {
    /// Reproducible pseudo-random values drawn from `name`: what `VarBuilder::seeded` gives the
    /// weight `name` (uniform in [-1, 1) for a name that is not a weight's), for example inputs.
    pub fn seeded(name: &str, shape: &[usize]) -> Self {
        weight(name, shape)
    }
}

/// The seeded value of the tensor `name` with `shape`.
pub fn weight(name: &str, shape: &[usize]) -> HostTensor {
    let seed = fnv1a64(name.as_bytes());
    let numel: usize = shape.iter().product();
    let last = name.rsplit('.').next().unwrap_or(name);
    let fan_in = if shape.len() >= 2 { numel / shape[0].max(1) } else { 1 };
    let f = |u: f64| -> f64 {
        match last {
            "running_var" => 0.5 + u,
            "running_mean" => 0.2 * (2.0 * u - 1.0),
            "bias" | "in_proj_bias" => 0.1 * (2.0 * u - 1.0),
            "weight" if shape.len() == 1 => 0.75 + 0.5 * u,
            "weight" | "in_proj_weight" => (2.0 * u - 1.0) * (3.0 / fan_in as f64).sqrt(),
            _ => 2.0 * u - 1.0,
        }
    };
    let data = (0..numel as u64).map(|i| f(uniform(seed, i)) as f32).collect();
    HostTensor::new(shape.to_vec(), data)
}

/// Uniform values in [-1, 1) from the stream `seed`: inputs for tests, benches and the CLI.
pub fn uniform_tensor(shape: &[usize], seed: u64) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::new(shape.to_vec(), (0..n as u64).map(|i| (2.0 * uniform(seed, i) - 1.0) as f32).collect())
}

/// `uniform_tensor` for shapes that come from a flag: an overflowing size or memory that cannot be
/// had is an error (`TooLarge`, `OutOfMemory`), not an abort.
pub fn try_uniform_tensor(shape: &[usize], seed: u64) -> crate::Result<HostTensor> {
    let what = || format!("an input of shape {shape:?}");
    let n = numel(shape).ok_or_else(|| crate::Error::TooLarge { what: what(), reason: "its element count overflows".into() })?;
    let mut data = Vec::new();
    data.try_reserve_exact(n).map_err(|_| crate::Error::OutOfMemory { what: what(), bytes: n.saturating_mul(4) })?;
    data.extend((0..n as u64).map(|i| (2.0 * uniform(seed, i) - 1.0) as f32));
    HostTensor::try_new(shape.to_vec(), data)
}

/// A fresh seed on every call, so tests and runs see new inputs each time; set `KILN_SEED` to
/// replay a particular run (tests print the seed they used).
pub fn fresh_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    if let Some(seed) = std::env::var("KILN_SEED").ok().and_then(|s| s.parse::<u64>().ok()) {
        return seed.wrapping_add(call);
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    mix(nanos ^ call.wrapping_mul(PHI))
}

/// One fresh seed per process (see [`fresh_seed`]), printed once so a failing test run can be
/// replayed with `KILN_SEED`.
pub fn run_seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        let seed = fresh_seed();
        println!("random inputs from seed {seed} (KILN_SEED={seed} replays them)");
        seed
    })
}
