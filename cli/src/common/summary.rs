//! People-readable results: a summary of a run's outputs (top classes, detections, ranges) and
//! timings in milliseconds.

use kiln::HostTensor;
use std::collections::BTreeMap;

/// Softmax of one row, for showing class probabilities.
fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = row.iter().map(|v| (v - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.iter().map(|e| e / sum).collect()
}

/// How many images' summaries to print at most.
const SHOWN_IMAGES: usize = 4;

/// ImageNet's class count: a `[N, 1000]` output is read as ImageNet class scores.
pub const IMAGENET_CLASSES: usize = 1000;

/// The output that holds a classifier's class scores, among `(name, shape)` pairs: the one named
/// `logits` (Kiln's name, the bundled models') when it is `[N, classes]`, else the only
/// `[N, 1000]` output (an imported torchvision or timm classifier, whose one output kiln-torch
/// names `output`). `None` when neither is there, or when several `[N, 1000]` outputs make the
/// choice ambiguous. A `logits` of another rank (a segmentation model's `[N, C, H, W]`, as
/// Hugging Face names it) is not class scores.
pub fn class_scores_output<'a>(outputs: impl IntoIterator<Item = (&'a str, &'a [usize])>) -> Option<&'a str> {
    let mut imagenet = Vec::new();
    for (name, shape) in outputs {
        if name == "logits" && shape.len() == 2 {
            return Some(name);
        }
        if let &[_, IMAGENET_CLASSES] = shape {
            imagenet.push(name);
        }
    }
    match imagenet.as_slice() {
        [only] => Some(only),
        _ => None,
    }
}

/// People-readable outputs: top-k classes for logits, top-k detections for CenterNet, shapes and
/// ranges for anything else. `input_width` (of an NCHW input) scales CenterNet's boxes to pixels.
pub fn summarize(outputs: &BTreeMap<String, HostTensor>, top: usize, input_width: Option<usize>) -> String {
    let mut s = String::new();
    let scores = class_scores_output(outputs.iter().map(|(n, t)| (n.as_str(), t.shape.as_slice())));
    if let Some(logits) = scores.and_then(|n| outputs.get(n)) {
        let (n, classes) = (logits.shape[0], logits.shape[1]);
        for (img, row) in logits.data.chunks_exact(classes.max(1)).enumerate().take(SHOWN_IMAGES) {
            let p = softmax(row);
            let mut idx: Vec<usize> = (0..classes).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            let names = if classes == IMAGENET_CLASSES { kiln_vision::imagenet_classes() } else { &[] };
            let best: Vec<String> = idx
                .iter()
                .take(top)
                .map(|&c| {
                    let name = names.get(c).map_or(String::new(), |n| format!("  {n}"));
                    format!("class {c:>4} (logit {:>7.3}, p {:.3}){name}", row[c], p[c])
                })
                .collect();
            s += &format!("image {img}: top-{}:\n    {}\n", best.len(), best.join("\n    "));
        }
        if n > SHOWN_IMAGES {
            s += &format!("({} more images)\n", n - SHOWN_IMAGES);
        }
    }
    let detections = outputs.get("detections").filter(|t| t.shape.len() == 3 && t.shape[2] == 6);
    if let Some(det) = detections {
        let (n, k) = (det.shape[0], det.shape[1]);
        // Boxes are in output-map coordinates; the maps are at stride input/map.
        let stride = match (outputs.get("hm").and_then(|hm| hm.shape.get(3)), input_width) {
            (Some(&w), Some(input)) => input as f32 / w as f32,
            _ => 1.0,
        };
        for img in 0..n.min(SHOWN_IMAGES) {
            s += &format!("image {img}: top-{} of {k} detections (box in input pixels):\n", top.min(k));
            for d in det.data[img * k * 6..(img + 1) * k * 6].chunks_exact(6).take(top) {
                s += &format!(
                    "    class {:>2}  score {:.3}  box ({:.1}, {:.1}) - ({:.1}, {:.1})\n",
                    d[5],
                    d[4],
                    d[0] * stride,
                    d[1] * stride,
                    d[2] * stride,
                    d[3] * stride
                );
            }
        }
    }
    for (name, t) in outputs {
        // Every output is shown: as class scores, as detections, or as its shape and range.
        if Some(name.as_str()) == scores || (name == "detections" && detections.is_some()) {
            continue;
        }
        let (lo, hi) = t.data.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let mean = t.data.iter().map(|&v| v as f64).sum::<f64>() / t.numel().max(1) as f64;
        s += &format!("{name}: {:?}, min {lo:.3}, max {hi:.3}, mean {mean:.3}\n", t.shape);
    }
    s
}

/// Milliseconds, with enough digits for both 0.3 ms and 3000 ms.
pub fn ms(d: f64) -> String {
    if d < 10.0 {
        format!("{d:.3} ms")
    } else {
        format!("{d:.1} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_summary_lists_the_top_classes_in_order() {
        let logits = HostTensor::new(vec![1, 5], vec![0.1, 3.0, -1.0, 2.0, 2.5]);
        let s = summarize(&BTreeMap::from([("logits".to_string(), logits)]), 3, Some(224));
        let classes: Vec<&str> = s.lines().filter(|l| l.contains("class")).map(|l| l.split_whitespace().nth(1).unwrap_or("")).collect();
        assert_eq!(classes, ["1", "4", "3"], "{s}");
        assert!(s.starts_with("image 0: top-3:"), "{s}");
    }

    #[test]
    fn an_imagenet_output_of_any_name_is_read_as_class_scores() {
        let shapes: [(&str, &[usize]); 2] = [("aux", &[2, 10]), ("output", &[2, 1000])];
        assert_eq!(class_scores_output(shapes), Some("output"));
        assert_eq!(class_scores_output([("logits", &[2, 10][..]), ("output", &[2, 1000][..])]), Some("logits"), "`logits` comes first");
        assert_eq!(class_scores_output([("a", &[1, 1000][..]), ("b", &[1, 1000][..])]), None, "two candidates: ambiguous");
        assert_eq!(class_scores_output([("output", &[1, 1000, 1][..])]), None);
        let mut row = vec![0.0; 1000];
        row[281] = 9.0;
        let s = summarize(&BTreeMap::from([("output".to_string(), HostTensor::new(vec![1, 1000], row))]), 1, Some(224));
        assert!(s.starts_with("image 0: top-1:\n    class  281 (logit   9.000, p 0."), "{s}");
        assert!(s.contains(&format!("  {}", kiln_vision::imagenet_classes()[281])), "the class is named:\n{s}");
        assert!(!s.contains("min"), "the scores are not summarised as a range too:\n{s}");
    }

    /// An output named `logits` that is not `[N, classes]` (a segmentation model's
    /// `[N, C, H, W]`) printed nothing at all; it is shown as its shape and range, as is a
    /// `detections` of another shape.
    #[test]
    fn outputs_named_logits_or_detections_of_other_shapes_are_still_shown() {
        let seg = HostTensor::new(vec![1, 2, 2, 2], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        assert_eq!(class_scores_output([("logits", &[1, 2, 2, 2][..])]), None);
        let s = summarize(&BTreeMap::from([("logits".to_string(), seg)]), 5, Some(224));
        assert_eq!(s, "logits: [1, 2, 2, 2], min 0.000, max 7.000, mean 3.500\n");
        let det = HostTensor::new(vec![1, 3], vec![1.0, 2.0, 3.0]);
        let s = summarize(&BTreeMap::from([("detections".to_string(), det)]), 5, Some(224));
        assert_eq!(s, "detections: [1, 3], min 1.000, max 3.000, mean 2.000\n");
    }

    #[test]
    fn detections_are_scaled_to_input_pixels() {
        // One image, two detections (x1, y1, x2, y2, score, class) on 4x4 maps of a 16x16 input.
        let det = HostTensor::new(vec![1, 2, 6], vec![1.0, 2.0, 3.0, 4.0, 0.9, 7.0, 0.0, 0.0, 1.0, 1.0, 0.5, 2.0]);
        let hm = HostTensor::zeros(vec![1, 80, 4, 4]);
        let s = summarize(&BTreeMap::from([("detections".to_string(), det), ("hm".to_string(), hm)]), 1, Some(16));
        assert!(s.contains("class  7  score 0.900  box (4.0, 8.0) - (12.0, 16.0)"), "{s}");
        assert!(!s.contains("class 2"), "only the top 1 is shown:\n{s}");
        assert!(s.contains("hm: [1, 80, 4, 4]"), "{s}");
    }
}
