//! The one comparison harness: every number a user sees about an error against a reference
//! (tests, `kiln compare`, GPU checks) is computed here.

use crate::host_tensor::HostTensor;
use std::fmt;

/// How far `got` is from a reference tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Comparison {
    pub name: String,
    /// `‖got − ref‖₂ / ‖ref‖₂`, in f64 (0 when both are zero; infinite when only `ref` is zero,
    /// NaN-free only if both are finite). Infinite on a shape mismatch.
    pub rel_l2: f64,
    /// `max |got − ref|`. Infinite on a shape mismatch.
    pub max_abs: f64,
    pub shape_ok: bool,
    /// The reference's shape (what the output should be).
    pub shape: Vec<usize>,
    /// `got`'s shape, reported when it differs.
    pub got_shape: Vec<usize>,
}

/// Compares `got` with `reference`; a shape mismatch is reported in the result, never a panic.
pub fn compare(name: &str, got: &HostTensor, reference: &HostTensor) -> Comparison {
    let shape_ok = got.shape == reference.shape && got.data.len() == reference.data.len();
    let (rel_l2, max_abs) = if shape_ok {
        let (mut diff2, mut ref2, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
        for (&g, &r) in got.data.iter().zip(&reference.data) {
            let d = g as f64 - r as f64;
            diff2 += d * d;
            ref2 += r as f64 * r as f64;
            // `max` would drop a NaN difference; a NaN must make the comparison fail.
            if d.abs() > max_abs || d.is_nan() {
                max_abs = d.abs();
            }
        }
        let rel = if diff2 == 0.0 { 0.0 } else { diff2.sqrt() / ref2.sqrt() };
        (rel, max_abs)
    } else {
        (f64::INFINITY, f64::INFINITY)
    };
    Comparison { name: name.to_string(), rel_l2, max_abs, shape_ok, shape: reference.shape.clone(), got_shape: got.shape.clone() }
}

impl Comparison {
    /// Shapes match and the relative L2 error is at most `tol_rel_l2` (a NaN never passes).
    pub fn passes(&self, tol_rel_l2: f64) -> bool {
        self.shape_ok && self.rel_l2 <= tol_rel_l2 && !self.max_abs.is_nan()
    }
}

impl fmt::Display for Comparison {
    /// `hm: rel_l2 3.1e-7 max_abs 2.0e-6 [1, 80, 64, 64]`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.shape_ok {
            return write!(f, "{}: shape mismatch: got {:?}, reference {:?}", self.name, self.got_shape, self.shape);
        }
        write!(f, "{}: rel_l2 {:.1e} max_abs {:.1e} {:?}", self.name, self.rel_l2, self.max_abs, self.shape)
    }
}

/// The index of the largest value of each row of `logits` (rows along dim 0; a rank-1 tensor is
/// one row). Ties go to the first index; NaN is never chosen over a number.
pub fn top1(logits: &HostTensor) -> Vec<usize> {
    let rows = if logits.shape.len() <= 1 { 1 } else { logits.shape[0] };
    if rows == 0 || logits.data.is_empty() {
        return vec![];
    }
    let width = logits.data.len() / rows;
    logits
        .data
        .chunks_exact(width)
        .map(|row| row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize], data: &[f32]) -> HostTensor {
        HostTensor::new(shape.to_vec(), data.to_vec())
    }

    #[test]
    fn relative_l2_and_max_abs() {
        let reference = t(&[2, 2], &[3.0, 0.0, 0.0, 4.0]);
        let got = t(&[2, 2], &[3.0, 0.5, 0.0, 4.0]);
        let c = compare("x", &got, &reference);
        assert!(c.shape_ok);
        assert!((c.rel_l2 - 0.1).abs() < 1e-12, "{}", c.rel_l2);
        assert_eq!(c.max_abs, 0.5);
        assert!(c.passes(0.1 + 1e-9));
        assert!(!c.passes(0.09));
        assert_eq!(c.to_string(), "x: rel_l2 1.0e-1 max_abs 5.0e-1 [2, 2]");
        assert!(compare("same", &reference, &reference).passes(0.0));
    }

    #[test]
    fn shape_mismatch_is_reported() {
        let c = compare("hm", &t(&[1, 4], &[1.0; 4]), &t(&[4, 1], &[1.0; 4]));
        assert!(!c.shape_ok);
        assert!(!c.passes(1.0));
        assert_eq!(c.to_string(), "hm: shape mismatch: got [1, 4], reference [4, 1]");
    }

    #[test]
    fn nan_never_passes() {
        let c = compare("n", &t(&[2], &[f32::NAN, 1.0]), &t(&[2], &[1.0, 1.0]));
        assert!(!c.passes(f64::INFINITY));
        assert!(c.max_abs.is_nan());
    }

    #[test]
    fn top1_per_row() {
        let logits = t(&[3, 3], &[0.1, 0.9, 0.2, 5.0, -1.0, 5.0, f32::NAN, -2.0, -1.0]);
        assert_eq!(top1(&logits), vec![1, 0, 2]);
        assert_eq!(top1(&t(&[4], &[0.0, 0.0, 3.0, 1.0])), vec![2]);
    }
}
