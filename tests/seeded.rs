//! Golden values of the seeded weight generator (Rust side). `tools/test_seeded.py` asserts the
//! same literals against the NumPy implementation the export script uses, so the fixtures and Kiln
//! agree on every weight bit for bit.

use kiln::dev::{fnv1a64, mix, uniform, weight};

/// (name, shape, flat index, f32 bit pattern): one per row of the scaling table.
const GOLDEN: &[(&str, &[usize], usize, u32)] = &[
    ("conv1.weight", &[64, 3, 7, 7], 0, 0x3C53_009E),
    ("conv1.weight", &[64, 3, 7, 7], 9407, 0xBDAF_B286),
    ("layer1.0.bn1.running_var", &[64], 5, 0x3F86_EE6F),
    ("layer1.0.bn1.running_mean", &[64], 17, 0x3CA1_15DB),
    ("layer1.0.bn1.weight", &[64], 0, 0x3F50_6152),
    ("fc.bias", &[1000], 999, 0xBD09_B40A),
    ("fc.weight", &[1000, 2048], 1_025_234, 0xBCC6_1D77),
    ("input.0", &[1, 3, 224, 224], 150_404, 0xBF1D_860E),
];

#[test]
fn primitives_match_published_values() {
    assert_eq!(fnv1a64(b""), 0xCBF2_9CE4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xAF63_DC4C_8601_EC8C);
    // splitmix64's first output from state 0.
    assert_eq!(mix(0x9E37_79B9_7F4A_7C15), 0xE220_A839_7B1D_CDAF);
    let seed = fnv1a64(b"conv1.weight");
    let u: Vec<f64> = (0..3).map(|i| uniform(seed, i)).collect();
    assert_eq!(u, [0.5450749789171447, 0.745161751328336, 0.022921737033572143]);
}

#[test]
fn golden_values_match_numpy() {
    for &(name, shape, flat, bits) in GOLDEN {
        let w = weight(name, shape);
        assert_eq!(w.shape, shape);
        let got = w.data[flat];
        assert_eq!(
            got.to_bits(),
            bits,
            "{name}[{flat}] = {got} ({:#x}), NumPy gives {:#x} ({})",
            got.to_bits(),
            bits,
            f32::from_bits(bits)
        );
    }
}

#[test]
fn golden_literals_are_the_values() {
    // The same literals as tools/test_seeded.py writes in decimal.
    assert_eq!(weight("conv1.weight", &[64, 3, 7, 7]).data[0], 0.012_878_565_f32);
    assert_eq!(weight("layer1.0.bn1.running_var", &[64]).data[5], 1.054_151_4_f32);
    assert_eq!(weight("input.0", &[1, 3, 224, 224]).data[150_404], -0.615_326_76_f32);
}

#[test]
fn ranges_follow_the_table() {
    let var = weight("x.running_var", &[4096]);
    assert!(var.data.iter().all(|&v| (0.5..1.5).contains(&v)));
    let gamma = weight("x.weight", &[4096]);
    assert!(gamma.data.iter().all(|&v| (0.75..1.25).contains(&v)));
    let w = weight("x.weight", &[64, 64, 3, 3]);
    let bound = (3.0f64 / (64.0 * 9.0)).sqrt() as f32;
    assert!(w.data.iter().all(|v| v.abs() <= bound));
    let mean = w.data.iter().map(|&v| v as f64).sum::<f64>() / w.numel() as f64;
    assert!(mean.abs() < 0.01 * bound as f64, "weights are centred, mean {mean}");
}
