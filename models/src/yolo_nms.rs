//! YOLO post-processing as one custom op, `yolo_nms`, registered the way CenterNet's decode is:
//! the shape rule and CPU reference here, the GPU layer below (`models/kernels/nms.cu`).
//!
//! Input: the detector's `[N, 4 + C, A]` (cx, cy, w, h, then C class probabilities per anchor, as
//! Ultralytics' eval forward returns). Output: `[N, K, 6]` rows (x1, y1, x2, y2, score, class),
//! the kept boxes first, best first; the rest of the K rows are padding `(0, 0, 0, 0, 0, -1)`, so
//! an image's detection count is the number of rows with `class >= 0` (Kiln nodes have one output;
//! a padded row is the count, and needs no second binding). Always f32, in every precision.
//!
//! Semantics (Ultralytics' `non_max_suppression` with `multi_label=False`, `agnostic=False`):
//! 1. each anchor's candidate is its best class (the first of equal maxima) when its score is
//!    `> conf` (compared in f32, as PyTorch compares an f32 tensor with a Python float);
//! 2. the `max_candidates` best candidates are kept (score descending, ties to the lower anchor),
//!    as TensorRT's EfficientNMS caps its candidates (Ultralytics' `max_nms` is 30000: with
//!    more than 4096 candidates above `conf`, the results may differ);
//! 3. greedy class-aware NMS in that order: a candidate is dropped when a kept box of its class
//!    overlaps it with IoU `> iou` (torchvision's `nms` arithmetic, IoU compared in f64), until
//!    `k` are kept. As a set this is `torchvision.ops.batched_nms` followed by `[:k]`.
//!
//! With the `frame_h`, `frame_w`, `input_h`, `input_w` attributes the boxes are mapped back
//! from the letterboxed model input to the frame (`scale_boxes`: minus the padding, divided by
//! the gain, clipped to the frame), see `yolo_letterbox`.

use kiln::plugin::{Attrs, CustomOp};
use kiln::HostTensor;
use kiln::{Error, Result, Tensor};

/// Candidates NMS looks at per image at most (`NMS_CAP` in nms.cu).
pub const MAX_CANDIDATES: usize = 4096;

/// The kernels of the GPU layer (`models/kernels/nms.cu`).
pub const NMS_CU: &str = include_str!("../kernels/nms.cu");

/// Every entry point the NMS layer launches (checked against `NMS_CU` by the NVRTC test).
pub fn nms_entry_points() -> Vec<String> {
    let mut names = vec!["nms_select".to_string(), "nms_mask".to_string(), "nms_scan".to_string()];
    for t in ["f32", "f16"] {
        names.push(format!("nms_keys_{t}"));
        names.push(format!("nms_boxes_{t}"));
    }
    names
}

/// Ultralytics' `predict` defaults: conf 0.25, IoU 0.7, 300 detections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NmsConfig {
    pub conf: f32,
    pub iou: f64,
    pub max_det: usize,
    pub max_candidates: usize,
    /// `Some(([frame_h, frame_w], [input_h, input_w]))`: map boxes back to the frame.
    pub frame: Option<([usize; 2], [usize; 2])>,
}

impl Default for NmsConfig {
    fn default() -> Self {
        Self { conf: 0.25, iou: 0.7, max_det: 300, max_candidates: MAX_CANDIDATES, frame: None }
    }
}

impl NmsConfig {
    fn attrs(&self) -> Vec<(&'static str, f64)> {
        let mut a =
            vec![("conf", self.conf as f64), ("iou", self.iou), ("k", self.max_det as f64), ("max_candidates", self.max_candidates as f64)];
        if let Some(([fh, fw], [ih, iw])) = self.frame {
            a.extend([("frame_h", fh as f64), ("frame_w", fw as f64), ("input_h", ih as f64), ("input_w", iw as f64)]);
        }
        a
    }
}

/// Applies `yolo_nms` to the detector output `predictions` `[N, 4 + C, A]`.
pub fn nms(predictions: &Tensor, config: &NmsConfig) -> Result<Tensor> {
    // Scores and pixel coordinates are compared in f32 whatever the engine's precision.
    predictions.tracer().require_fp32(&predictions.scope_path("yolo_nms"));
    predictions.custom("yolo_nms", &config.attrs(), &[])
}

/// The op's attributes, checked.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Params {
    pub conf: f32,
    pub iou: f64,
    pub k: usize,
    pub cap: usize,
    /// (pad_x, pad_y, gain, frame_w, frame_h)
    pub map: Option<(f32, f32, f32, f32, f32)>,
}

fn count_attr(attrs: &Attrs, key: &str, default: usize, max: usize) -> std::result::Result<usize, String> {
    let v = attrs.get(key).copied().unwrap_or(default as f64);
    if !(v >= 1.0 && v.fract() == 0.0 && v <= max as f64) {
        return Err(format!("attribute {key} must be an integer in [1, {max}], got {v}"));
    }
    Ok(v as usize)
}

/// Ultralytics' `scale_boxes` geometry for a frame letterboxed to the model input: the gain and
/// the padding (left, top) it subtracts. Shared with `yolo_letterbox`.
pub fn unletterbox(frame: [usize; 2], input: [usize; 2]) -> (f64, f64, f64) {
    let [fh, fw] = frame.map(|v| v as f64);
    let [ih, iw] = input.map(|v| v as f64);
    let gain = (ih / fh).min(iw / fw);
    let pad_x = ((iw - fw * gain) / 2.0 - 0.1).round_ties_even();
    let pad_y = ((ih - fh * gain) / 2.0 - 0.1).round_ties_even();
    (gain, pad_x, pad_y)
}

pub(crate) fn params(attrs: &Attrs) -> std::result::Result<Params, String> {
    let conf = attrs.get("conf").copied().unwrap_or(0.25);
    if !(0.0..1.0).contains(&conf) {
        return Err(format!("attribute conf must be in [0, 1), got {conf}"));
    }
    let iou = attrs.get("iou").copied().unwrap_or(0.7);
    if !(0.0..=1.0).contains(&iou) {
        return Err(format!("attribute iou must be in [0, 1], got {iou}"));
    }
    let k = count_attr(attrs, "k", 300, 1 << 20)?;
    let cap = count_attr(attrs, "max_candidates", MAX_CANDIDATES, MAX_CANDIDATES)?;
    let keys = ["frame_h", "frame_w", "input_h", "input_w"];
    let given = keys.iter().filter(|k| attrs.contains_key(**k)).count();
    let map = match given {
        0 => None,
        4 => {
            let v: Vec<usize> = keys.iter().map(|k| count_attr(attrs, k, 1, 1 << 16)).collect::<std::result::Result<_, _>>()?;
            let (gain, px, py) = unletterbox([v[0], v[1]], [v[2], v[3]]);
            Some((px as f32, py as f32, gain as f32, v[1] as f32, v[0] as f32))
        }
        _ => return Err(format!("attributes {keys:?} go together: give all four or none, got {given}")),
    };
    Ok(Params { conf: conf as f32, iou, k, cap, map })
}

/// Input `[N, 4 + C, A]` with C >= 1; output `[N, k, 6]`.
fn nms_shape(attrs: &Attrs, inputs: &[&[usize]]) -> std::result::Result<Vec<usize>, String> {
    let p = params(attrs)?;
    let [x] = inputs else {
        return Err(format!("yolo_nms expects 1 input (the predictions), got {}", inputs.len()));
    };
    if x.len() != 3 || x[1] < 5 || x[2] == 0 {
        return Err(format!("predictions must be [N, 4 + classes, anchors] with at least one class and anchor, got {x:?}"));
    }
    if x[2] >= i32::MAX as usize || x[1].checked_mul(x[2]).is_none_or(|e| e >= i32::MAX as usize) {
        return Err(format!("predictions {x:?} exceed the NMS's 32-bit indices"));
    }
    Ok(vec![x[0], p.k, 6])
}

/// IoU of two xyxy boxes with torchvision's `nms` arithmetic (f32), compared in f64.
pub(crate) fn iou_above(a: &[f32; 4], b: &[f32; 4], thr: f64) -> bool {
    let area_a = (a[2] - a[0]) * (a[3] - a[1]);
    let area_b = (b[2] - b[0]) * (b[3] - b[1]);
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = w * h;
    let iou = inter / (area_a + area_b - inter);
    iou as f64 > thr
}

/// The CPU reference of the module docs.
fn nms_cpu(attrs: &Attrs, inputs: &[&HostTensor]) -> Result<HostTensor> {
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape.as_slice()).collect();
    let shape_err = |reason: String| Error::Shape {
        path: "yolo_nms".into(),
        op: "yolo_nms".into(),
        reason: reason.into(),
        got: shapes.iter().map(|s| s.to_vec()).collect(),
    };
    let out_shape = nms_shape(attrs, &shapes).map_err(shape_err)?;
    let p = params(attrs).map_err(shape_err)?;
    let x = inputs[0];
    let (n, rows, a) = (x.shape[0], x.shape[1], x.shape[2]);
    let c = rows - 4;
    let mut out = Vec::with_capacity(n * p.k * 6);
    for img in 0..n {
        let pred = &x.data[img * rows * a..(img + 1) * rows * a];
        // (score, anchor, class) of every anchor above the threshold.
        let mut cand: Vec<(f32, usize, usize)> = Vec::new();
        for anchor in 0..a {
            let mut best: Option<(f32, usize)> = None;
            for cls in 0..c {
                let v = pred[(4 + cls) * a + anchor];
                match best {
                    None if !v.is_nan() => best = Some((v, cls)),
                    Some((b, _)) if v > b => best = Some((v, cls)),
                    _ => {}
                }
            }
            if let Some((score, cls)) = best.filter(|(s, _)| *s > p.conf) {
                cand.push((score, anchor, cls));
            }
        }
        cand.sort_by(|l, r| r.0.total_cmp(&l.0).then(l.1.cmp(&r.1)));
        cand.truncate(p.cap);
        let boxes: Vec<[f32; 4]> = cand
            .iter()
            .map(|&(_, anchor, _)| {
                let (cx, cy) = (pred[anchor], pred[a + anchor]);
                let (hw, hh) = (pred[2 * a + anchor] / 2.0, pred[3 * a + anchor] / 2.0);
                [cx - hw, cy - hh, cx + hw, cy + hh]
            })
            .collect();
        let mut kept: Vec<usize> = Vec::with_capacity(p.k);
        for i in 0..cand.len() {
            if kept.len() == p.k {
                break;
            }
            if !kept.iter().any(|&j| cand[j].2 == cand[i].2 && iou_above(&boxes[j], &boxes[i], p.iou)) {
                kept.push(i);
            }
        }
        for &i in &kept {
            let mut b = boxes[i];
            if let Some((px, py, gain, fw, fh)) = p.map {
                for (q, v) in b.iter_mut().enumerate() {
                    let (pad, lim) = if q % 2 == 0 { (px, fw) } else { (py, fh) };
                    *v = ((*v - pad) / gain).max(0.0).min(lim);
                }
            }
            out.extend_from_slice(&[b[0], b[1], b[2], b[3], cand[i].0, cand[i].2 as f32]);
        }
        for _ in kept.len()..p.k {
            out.extend_from_slice(&[0.0, 0.0, 0.0, 0.0, 0.0, -1.0]);
        }
    }
    Ok(HostTensor::new(out_shape, out))
}

kiln::inventory::submit! {
    CustomOp { name: "yolo_nms", infer_shape: nms_shape, cpu: nms_cpu }
}

/// The detections of `out` (`[N, K, 6]`) for image `n`: its rows with `class >= 0`.
pub fn detections(out: &HostTensor, n: usize) -> Vec<[f32; 6]> {
    let k = out.shape[1];
    out.data[n * k * 6..(n + 1) * k * 6].chunks_exact(6).filter(|r| r[5] >= 0.0).map(|r| [r[0], r[1], r[2], r[3], r[4], r[5]]).collect()
}

/// The largest f32 `t` with `x > t` exactly when `x as f64 > thr`, for every f32 `x`.
pub(crate) fn f32_threshold(thr: f64) -> f32 {
    let t = thr as f32;
    if (t as f64) > thr {
        // The float below: x > it means x >= t, which is x > thr.
        f32::from_bits(if t > 0.0 { t.to_bits() - 1 } else { t.to_bits() + 1 })
    } else {
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(pairs: &[(&str, f64)]) -> Attrs {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    /// Predictions for one image from (cx, cy, w, h, class scores) per anchor.
    fn preds(anchors: &[([f32; 4], [f32; 2])]) -> HostTensor {
        let a = anchors.len();
        let mut d = vec![0f32; 6 * a];
        for (i, (b, s)) in anchors.iter().enumerate() {
            for q in 0..4 {
                d[q * a + i] = b[q];
            }
            d[4 * a + i] = s[0];
            d[5 * a + i] = s[1];
        }
        HostTensor::new(vec![1, 6, a], d)
    }

    #[test]
    fn suppresses_within_a_class_only() {
        let x = preds(&[
            ([10.0, 10.0, 10.0, 10.0], [0.9, 0.1]), // kept
            ([11.0, 10.0, 10.0, 10.0], [0.8, 0.1]), // IoU 0.82 with the first, same class: dropped
            ([11.0, 10.0, 10.0, 10.0], [0.1, 0.7]), // other class: kept
            ([50.0, 50.0, 4.0, 4.0], [0.2, 0.3]),   // kept, class 1
            ([80.0, 80.0, 4.0, 4.0], [0.2, 0.1]),   // below conf
        ]);
        let out = nms_cpu(&attrs(&[("k", 5.0)]), &[&x]).expect("nms");
        assert_eq!(out.shape, [1, 5, 6]);
        let d = detections(&out, 0);
        let summary: Vec<(f32, f32)> = d.iter().map(|r| (r[4], r[5])).collect();
        assert_eq!(summary, [(0.9, 0.0), (0.7, 1.0), (0.3, 1.0)]);
        assert_eq!(d[0][..4], [5.0, 5.0, 15.0, 15.0]);
        assert_eq!(&out.data[3 * 6..4 * 6], &[0.0, 0.0, 0.0, 0.0, 0.0, -1.0], "padding row");
    }

    #[test]
    fn ties_go_to_the_lower_anchor_and_k_and_cap_truncate() {
        let far = |i: f32| ([i * 100.0, 0.0, 10.0, 10.0], [0.5, 0.0]);
        let x = preds(&[far(0.0), far(1.0), far(2.0), far(3.0)]);
        let out = nms_cpu(&attrs(&[("k", 2.0)]), &[&x]).expect("nms");
        let d = detections(&out, 0);
        assert_eq!(d.iter().map(|r| r[0]).collect::<Vec<_>>(), [-5.0, 95.0]);
        let out = nms_cpu(&attrs(&[("k", 4.0), ("max_candidates", 3.0)]), &[&x]).expect("nms");
        assert_eq!(detections(&out, 0).len(), 3, "only 3 candidates are looked at");
    }

    #[test]
    fn maps_boxes_back_to_the_frame() {
        // A 100x200 (h x w) frame letterboxed to 64x64: gain 0.32, 16 rows of padding on top.
        let (gain, px, py) = unletterbox([100, 200], [64, 64]);
        assert_eq!((gain, px, py), (0.32, 0.0, 16.0));
        let x = preds(&[([32.0, 32.0, 16.0, 8.0], [0.9, 0.0])]);
        let a = attrs(&[("k", 1.0), ("frame_h", 100.0), ("frame_w", 200.0), ("input_h", 64.0), ("input_w", 64.0)]);
        let d = detections(&nms_cpu(&a, &[&x]).expect("nms"), 0);
        let want = [24.0f32 / 0.32, (28.0 - 16.0) / 0.32, 40.0 / 0.32, (36.0 - 16.0) / 0.32];
        for q in 0..4 {
            assert!((d[0][q] - want[q]).abs() < 1e-4, "{:?} vs {want:?}", d[0]);
        }
    }

    #[test]
    fn threshold_matches_the_f64_comparison() {
        for thr in [0.7, 0.5, 0.45, 0.3, 0.9, 1.0 / 3.0] {
            let t = f32_threshold(thr);
            let near = [t, f32::from_bits(t.to_bits() + 1), f32::from_bits(t.to_bits() - 1), thr as f32];
            for x in near {
                assert_eq!(x > t, x as f64 > thr, "thr {thr}, x {x}");
            }
        }
    }

    /// The GPU layer's algorithm (nms.cu) step by step on the CPU: keys, radix select of the
    /// cap-th key, sort, the IoU bitmask, the greedy scan. It must give the reference's rows.
    fn gpu_algorithm(attrs: &Attrs, x: &HostTensor) -> Vec<f32> {
        let p = params(attrs).expect("params");
        let (n, rows, a) = (x.shape[0], x.shape[1], x.shape[2]);
        let c = rows - 4;
        let mut out = Vec::new();
        for img in 0..n {
            let pred = &x.data[img * rows * a..(img + 1) * rows * a];
            let best = |anchor: usize| -> (f32, i32) {
                let (mut best, mut cls) = (0f32, -1i32);
                for k in 0..c {
                    let v = pred[(4 + k) * a + anchor];
                    if if cls < 0 { !v.is_nan() } else { v > best } {
                        (best, cls) = (v, k as i32);
                    }
                }
                (best, cls)
            };
            let keys: Vec<u64> = (0..a)
                .map(|i| {
                    let (b, cls) = best(i);
                    if cls >= 0 && b > p.conf {
                        ((b.to_bits() as u64) << 32) | (0xffff_ffffu32 - i as u32) as u64
                    } else {
                        0
                    }
                })
                .collect();
            let total = keys.iter().filter(|&&k| k != 0).count();
            let mut thr = 1u64;
            if total > p.cap {
                let (mut prefix, mut mask, mut need) = (0u64, 0u64, p.cap);
                for shift in (0..=56).rev().step_by(8) {
                    let mut hist = [0usize; 256];
                    for &v in &keys {
                        if v != 0 && v & mask == prefix {
                            hist[((v >> shift) & 0xff) as usize] += 1;
                        }
                    }
                    let mut d = 255;
                    while d > 0 && hist[d] < need {
                        need -= hist[d];
                        d -= 1;
                    }
                    prefix |= (d as u64) << shift;
                    mask |= 0xff << shift;
                }
                thr = prefix;
            }
            let mut sorted: Vec<u64> = keys.iter().copied().filter(|&v| v != 0 && v >= thr).collect();
            assert!(sorted.len() <= p.cap);
            sorted.sort_unstable_by(|x, y| y.cmp(x));
            let cand: Vec<([f32; 4], i32, f32)> = sorted
                .iter()
                .map(|&key| {
                    let i = (0xffff_ffffu32 - (key & 0xffff_ffff) as u32) as usize;
                    let (hw, hh) = (pred[2 * a + i] / 2.0, pred[3 * a + i] / 2.0);
                    let b = [pred[i] - hw, pred[a + i] - hh, pred[i] + hw, pred[a + i] + hh];
                    (b, best(i).1, f32::from_bits((key >> 32) as u32))
                })
                .collect();
            let words = p.cap.div_ceil(64);
            let t = f32_threshold(p.iou);
            let mut maskbits = vec![0u64; cand.len() * words];
            for i in 0..cand.len() {
                for j in i + 1..cand.len() {
                    // The f32 threshold the GPU compares with gives the f64 comparison's answer.
                    let (bi, bj) = (&cand[i].0, &cand[j].0);
                    let area_i = (bi[2] - bi[0]) * (bi[3] - bi[1]);
                    let area_j = (bj[2] - bj[0]) * (bj[3] - bj[1]);
                    let w = (bi[2].min(bj[2]) - bi[0].max(bj[0])).max(0.0);
                    let h = (bi[3].min(bj[3]) - bi[1].max(bj[1])).max(0.0);
                    let iou = w * h / (area_i + area_j - w * h);
                    if cand[i].1 == cand[j].1 && iou > t {
                        maskbits[i * words + j / 64] |= 1 << (j % 64);
                    }
                }
            }
            let mut removed = vec![0u64; words];
            let mut kept = 0;
            for i in 0..cand.len() {
                if kept == p.k {
                    break;
                }
                if (removed[i / 64] >> (i % 64)) & 1 == 1 {
                    continue;
                }
                let (b, cls, score) = cand[i];
                out.extend_from_slice(&[b[0], b[1], b[2], b[3], score, cls as f32]);
                kept += 1;
                for (r, m) in removed.iter_mut().zip(&maskbits[i * words..(i + 1) * words]) {
                    *r |= m;
                }
            }
            for _ in kept..p.k {
                out.extend_from_slice(&[0.0, 0.0, 0.0, 0.0, 0.0, -1.0]);
            }
        }
        out
    }

    /// Crowded predictions: boxes around a few centres, scores from a small generator.
    fn crowded(n: usize, c: usize, a: usize, seed: u64) -> HostTensor {
        let mut s = seed;
        let mut next = |m: u64| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) % m
        };
        let mut d = vec![0f32; n * (4 + c) * a];
        for img in 0..n {
            let p = &mut d[img * (4 + c) * a..(img + 1) * (4 + c) * a];
            let centres: Vec<(u64, u64)> = (0..12).map(|_| (40 + next(500), 40 + next(500))).collect();
            for i in 0..a {
                let (cx, cy) = centres[next(12) as usize];
                p[i] = cx as f32 + next(1000) as f32 / 125.0 - 4.0;
                p[a + i] = cy as f32 + next(1000) as f32 / 125.0 - 4.0;
                p[2 * a + i] = 16.0 + next(4800) as f32 / 100.0;
                p[3 * a + i] = 16.0 + next(4800) as f32 / 100.0;
                for k in 0..c {
                    p[(4 + k) * a + i] = next(1 << 20) as f32 / (1 << 20) as f32;
                }
            }
        }
        HostTensor::new(vec![n, 4 + c, a], d)
    }

    #[test]
    fn the_gpu_algorithm_gives_the_reference_rows() {
        let settings: [&[(&str, f64)]; 4] =
            [&[], &[("conf", 0.5), ("iou", 0.3), ("k", 1000.0)], &[("max_candidates", 64.0)], &[("iou", 0.45), ("k", 20.0)]];
        for (seed, a) in [(1, 700), (2, 6000)] {
            let x = crowded(2, 3, a, seed);
            for pairs in settings {
                let at = attrs(pairs);
                let want = nms_cpu(&at, &[&x]).expect("nms");
                let kept: Vec<usize> = (0..2).map(|n| detections(&want, n).len()).collect();
                println!("{a} anchors {pairs:?}: kept {kept:?}");
                assert_eq!(gpu_algorithm(&at, &x), want.data, "{a} anchors, {pairs:?}");
            }
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(nms_shape(&Attrs::new(), &[&[2, 84, 8400]]).is_ok());
        assert!(nms_shape(&Attrs::new(), &[&[2, 4, 8400]]).unwrap_err().contains("classes"));
        assert!(nms_shape(&attrs(&[("k", 0.0)]), &[&[2, 84, 8400]]).unwrap_err().contains("k"));
        assert!(nms_shape(&attrs(&[("max_candidates", 5000.0)]), &[&[2, 84, 8400]]).unwrap_err().contains("max_candidates"));
        assert!(nms_shape(&attrs(&[("conf", 1.5)]), &[&[2, 84, 8400]]).unwrap_err().contains("conf"));
        assert!(nms_shape(&attrs(&[("frame_h", 10.0)]), &[&[2, 84, 8400]]).unwrap_err().contains("together"));
        assert!(nms_shape(&Attrs::new(), &[&[2, 84, 8400], &[1]]).unwrap_err().contains("1 input"));
        assert!(kiln::plugin::lookup("yolo_nms").is_some());
    }
}

// ---- GPU converter: `yolo_nms` as an engine layer (kernels/nms.cu) --------------------------

mod gpu {
    use super::{f32_threshold, params, Params};
    use kiln::plugin::{launch, CudaFunction, KArg};
    use kiln::plugin::{BuildCtx, Elem, Layer, RunCtx, ValueId};
    use kiln::Result;
    use kiln::{plugin::Op, NodeId};

    const THREADS: u32 = 1024;

    pub struct NmsLayer {
        path: String,
        keys_fn: CudaFunction,
        select: CudaFunction,
        boxes_fn: CudaFunction,
        mask_fn: CudaFunction,
        scan: CudaFunction,
        pred: ValueId,
        out: ValueId,
        keys: ValueId,
        sorted: ValueId,
        count: ValueId,
        boxes: ValueId,
        cls: ValueId,
        scores: ValueId,
        mask: ValueId,
        /// Classes, anchors.
        ca: [usize; 2],
        p: Params,
    }

    impl Layer for NmsLayer {
        fn path(&self) -> &str {
            &self.path
        }
        fn kind(&self) -> String {
            format!("kernel:yolo_nms(k={}, cap={})", self.p.k, self.p.cap)
        }
        fn enqueue(&self, rt: &RunCtx, batch: usize) -> Result<()> {
            let n = u32::try_from(batch).ok().filter(|&b| b <= 65535).ok_or_else(|| kiln::Error::Binding {
                name: self.path.clone(),
                reason: format!("batch {batch} exceeds the NMS's grid limit of 65535 images"),
            })?;
            let [c, a] = self.ca;
            let cap = self.p.cap;
            let words = cap.div_ceil(64) as u32;
            let ptr = |v: ValueId| KArg::Ptr(rt.ptr(v));
            let pred = [ptr(self.pred), KArg::I32(c as i32), KArg::I32(a as i32)];
            launch(
                rt,
                &self.keys_fn,
                (a.div_ceil(256) as u32, n, 1),
                (256, 1, 1),
                0,
                &[&pred[..], &[KArg::F32(self.p.conf), ptr(self.keys)]].concat(),
            )?;
            let sel = [ptr(self.keys), KArg::I32(a as i32), KArg::I32(cap as i32), ptr(self.sorted), ptr(self.count)];
            launch(rt, &self.select, (n, 1, 1), (THREADS, 1, 1), 0, &sel)?;
            let bx = [ptr(self.sorted), ptr(self.count), KArg::I32(cap as i32), ptr(self.boxes), ptr(self.cls), ptr(self.scores)];
            launch(rt, &self.boxes_fn, (cap.div_ceil(256) as u32, n, 1), (256, 1, 1), 0, &[&pred[..], &bx[..]].concat())?;
            let thr = f32_threshold(self.p.iou);
            let mk = [
                ptr(self.boxes),
                ptr(self.cls),
                ptr(self.count),
                KArg::I32(cap as i32),
                KArg::I32(words as i32),
                KArg::F32(thr),
                ptr(self.mask),
            ];
            launch(rt, &self.mask_fn, (words, words, n), (64, 1, 1), 0, &mk)?;
            let (px, py, gain, fw, fh) = self.p.map.unwrap_or((0.0, 0.0, 1.0, 0.0, 0.0));
            let sc = [
                ptr(self.boxes),
                ptr(self.cls),
                ptr(self.scores),
                ptr(self.count),
                ptr(self.mask),
                KArg::I32(cap as i32),
                KArg::I32(words as i32),
                KArg::I32(self.p.k as i32),
                KArg::I32(self.p.map.is_some() as i32),
                KArg::F32(px),
                KArg::F32(py),
                KArg::F32(gain),
                KArg::F32(fw),
                KArg::F32(fh),
                ptr(self.out),
            ];
            launch(rt, &self.scan, (n, 1, 1), (64, 1, 1), 0, &sc)
        }
    }

    pub fn convert_nms(ctx: &mut BuildCtx, node: NodeId) -> Result<Box<dyn Layer>> {
        let Op::Custom(kiln::plugin::CustomCall { attrs, .. }) = &ctx.node(node).op else {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, "is not yolo_nms"));
        };
        let p = params(attrs).map_err(|r| ctx.err(node, kiln::LowerKind::Operands, r))?;
        let (pred, out) = (ctx.input(node, 0)?, ctx.output(node)?);
        let d = ctx.value(pred).clone();
        let [rows, a] = d.dims[..] else {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, format!("predictions must be [4 + C, A] per image, got {:?}", d.dims)));
        };
        if d.layout.order() != [0, 1] {
            return Err(ctx.err(node, kiln::LowerKind::Unsupported, format!("predictions must be contiguous, got {:?}", d.layout)));
        }
        if p.k > i32::MAX as usize / 6 {
            return Err(ctx.err(node, kiln::LowerKind::TooLarge, format!("k = {} is too large for the GPU layer", p.k)));
        }
        ctx.set_output_elem(Elem::F32)?;
        let e = d.elem.suffix();
        ctx.kernels.add_source("nms.cu", super::NMS_CU)?;
        let keys_fn = ctx.kernels.get(&format!("nms_keys_{e}"))?;
        let boxes_fn = ctx.kernels.get(&format!("nms_boxes_{e}"))?;
        let select = ctx.kernels.get("nms_select")?;
        let mask_fn = ctx.kernels.get("nms_mask")?;
        let scan = ctx.kernels.get("nms_scan")?;
        let cap = p.cap;
        let words = cap.div_ceil(64);
        Ok(Box::new(NmsLayer {
            path: ctx.node(node).path.clone(),
            keys_fn,
            select,
            boxes_fn,
            mask_fn,
            scan,
            pred,
            out,
            keys: ctx.scratch(a * 8),
            sorted: ctx.scratch(cap * 8),
            count: ctx.scratch(4),
            boxes: ctx.scratch(cap * 16),
            cls: ctx.scratch(cap * 4),
            scores: ctx.scratch(cap * 4),
            mask: ctx.scratch(cap * words * 8),
            ca: [rows - 4, a],
            p,
        }))
    }
}

kiln::register_converter!("yolo_nms", gpu::convert_nms);
