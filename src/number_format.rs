//! The 8-bit number formats, int8 and `float8_e4m3fn`: their ranges, the e4m3 grid and its bit
//! encoding, and the symmetric scale of a range. Shared by the quantisation ops, calibration and
//! the engine's 8-bit storage; it imports nothing of Kiln.

use serde::{Deserialize, Serialize};

/// The 8-bit number format of a quantised value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
pub enum QuantFormat {
    /// Integers in `[qmin, qmax]` (int8: -128..=127).
    #[default]
    Int8,
    /// `float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, largest finite 448.
    Fp8E4m3,
}

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

impl QuantFormat {
    /// The largest magnitude a quantised value takes: a symmetric scale is `amax / max_abs()`.
    pub fn max_abs(self) -> f32 {
        match self {
            QuantFormat::Int8 => 127.0,
            QuantFormat::Fp8E4m3 => E4M3_MAX,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Int8 => "int8",
            QuantFormat::Fp8E4m3 => "fp8",
        }
    }
}

/// `amax / max_abs(format)`, at least `MIN_SCALE`; 1 for an all-zero range (any scale maps
/// zeros to zero).
pub fn symmetric_scale(amax: f32, format: QuantFormat) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        (amax / format.max_abs()).max(MIN_SCALE)
    } else {
        1.0
    }
}

/// The smallest scale a quantiser takes: f32's smallest normal, 2^-126, so that `1 / scale`, by
/// which the quantisers multiply, is finite (a subnormal scale such as 1e-45 gives infinity, and
/// zeros times it NaN).
pub const MIN_SCALE: f32 = f32::MIN_POSITIVE;

/// Why `scale` cannot be a quantisation scale in `format`, or `Ok`: it must be at least
/// [`MIN_SCALE`], and the largest code times it (127 for int8, 448 for e4m3) must be finite, so a
/// symmetric scale of any finite range fits (NaN does not).
pub fn check_scale(scale: f32, format: QuantFormat) -> Result<(), String> {
    let max = f32::MAX / format.max_abs();
    if (MIN_SCALE..=max).contains(&scale) {
        Ok(())
    } else {
        Err(format!(
            "a scale must be positive, finite and within {MIN_SCALE:e} and {max:e} (its reciprocal and {} times it finite), got {scale:e}",
            format.max_abs()
        ))
    }
}

/// `v` rounded to the nearest IEEE half (ties to even, subnormals kept, overflow to ±inf): what
/// an engine's FP16 storage keeps of an f32 value (`cvt.rn.f16.f32`, kernels/common.cuh's
/// `from_f32`; the f16 uploads of weights, `to_elem_bytes`). The CPU executor applies it to every
/// value a simulation graph marks f16 (`calibrate::simulation`).
pub fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// `v` rounded to the nearest `float8_e4m3fn` value (ties to even, subnormals kept), for
/// `|v| <= 448`; larger magnitudes are clamped to 448 first by the callers. NaN stays NaN.
pub fn round_e4m3(v: f32) -> f32 {
    if v.is_nan() || v == 0.0 {
        return v;
    }
    let a = v.abs().min(E4M3_MAX);
    // The spacing of e4m3 values around `a`: 3 mantissa bits below its binary exponent, which
    // stops at -6 (the subnormals share the smallest normal's spacing, 2^-9).
    let exp = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    let step = f32::from_bits(((exp - 3 + 127) as u32) << 23);
    // Dividing by a power of two is exact, so the only rounding is this one.
    ((a / step).round_ties_even() * step).copysign(v)
}

/// The e4m3 bits of `v`, which must lie on the e4m3 grid (`round_e4m3`'s output): sign, 4
/// exponent bits (bias 7), 3 mantissa bits; subnormals below 2^-6 (mirrored by `kernels/quant.cu`).
pub fn encode_e4m3(v: f32) -> u8 {
    let b = v.to_bits();
    let sign = ((b >> 24) & 0x80) as u8;
    let a = v.abs();
    if a == 0.0 {
        return sign;
    }
    if a < 0.015625 {
        return sign | (a * 512.0) as u8;
    }
    let e = ((b >> 23) & 0xff) as i32 - 127;
    sign | (((e + 7) << 3) as u8 | ((b >> 20) & 7) as u8)
}
