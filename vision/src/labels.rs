//! Class names and the top of a classifier's answer.
//!
//! `data/imagenet_classes.txt` is torchvision's `weights.meta["categories"]` (the 1000 ImageNet-1k
//! names its classifiers share), `data/coco_classes.txt` Ultralytics' 80 COCO names, one a line,
//! line i naming class i (`tools/export_class_names.py` writes both).

use kiln::HostTensor;
use std::sync::OnceLock;

const IMAGENET: &str = include_str!("../data/imagenet_classes.txt");
const COCO: &str = include_str!("../data/coco_classes.txt");

/// The 1000 ImageNet-1k class names, by class index (281 is "tabby").
pub fn imagenet_classes() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| IMAGENET.lines().collect())
}

/// The 80 COCO class names of Ultralytics' detectors and CenterNet, by class index (0 is "person").
pub fn coco_classes() -> &'static [&'static str] {
    static NAMES: OnceLock<Vec<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| COCO.lines().collect())
}

/// The softmax of `logits`, computed in f64 from the largest logit (no overflow) and rounded to f32.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f64> = logits.iter().map(|&l| (f64::from(l) - f64::from(max)).exp()).collect();
    let sum: f64 = exp.iter().sum();
    exp.iter().map(|&e| (e / sum) as f32).collect()
}

/// One class of a classifier's answer.
#[derive(Clone, Debug, PartialEq)]
pub struct Prediction {
    pub class: usize,
    pub logit: f32,
    /// The softmax probability over all the logits.
    pub probability: f32,
}

impl Prediction {
    /// The class's name in `names`, or its number when `names` is too short.
    pub fn name(&self, names: &[&str]) -> String {
        names.get(self.class).map_or_else(|| format!("class {}", self.class), |n| n.to_string())
    }
}

/// The `k` largest logits (fewer if there are fewer), largest first, ties to the lower class as
/// `torch.topk` on the CPU orders them; NaN sorts last.
pub fn top_k(logits: &[f32], k: usize) -> Vec<Prediction> {
    let probabilities = softmax(logits);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (logits[a], logits[b]);
        y.partial_cmp(&x).unwrap_or_else(|| x.is_nan().cmp(&y.is_nan())).then(a.cmp(&b))
    });
    order.into_iter().take(k).map(|class| Prediction { class, logit: logits[class], probability: probabilities[class] }).collect()
}

/// `top_k` of each row of `logits` `[N, classes]` (any shape: the last axis is the classes).
pub fn top_k_batch(logits: &HostTensor, k: usize) -> Vec<Vec<Prediction>> {
    let classes = logits.shape.last().copied().unwrap_or(0);
    if classes == 0 {
        return vec![];
    }
    logits.data.chunks(classes).map(|row| top_k(row, k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_names_are_complete() {
        let imagenet = imagenet_classes();
        assert_eq!(imagenet.len(), 1000);
        assert_eq!(imagenet[0], "tench");
        assert_eq!(&imagenet[281..=285], ["tabby", "tiger cat", "Persian cat", "Siamese cat", "Egyptian cat"]);
        assert_eq!(imagenet[967], "espresso");
        assert_eq!(imagenet[999], "toilet tissue");
        let coco = coco_classes();
        assert_eq!(coco.len(), 80);
        assert_eq!([coco[0], coco[2], coco[16], coco[79]], ["person", "car", "dog", "toothbrush"]);
        assert!(imagenet.iter().chain(coco).all(|n| !n.is_empty() && n.trim() == *n));
    }

    #[test]
    fn softmax_is_stable_and_sums_to_one() {
        let p = softmax(&[1000.0, 1000.0, -1000.0]);
        assert_eq!(p, [0.5, 0.5, 0.0]);
        let p = softmax(&[1.0, 2.0, 3.0]);
        let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|x| x.exp()).collect();
        let s: f64 = e.iter().sum();
        for (a, b) in p.iter().zip(&e) {
            assert!((f64::from(*a) - b / s).abs() < 1e-7);
        }
    }

    #[test]
    fn top_k_orders_by_logit_with_ties_to_the_lower_class() {
        let t = top_k(&[0.5, 3.0, f32::NAN, 3.0, -1.0], 3);
        assert_eq!(t.iter().map(|p| p.class).collect::<Vec<_>>(), [1, 3, 0]);
        assert_eq!(t[0].logit, 3.0);
        assert_eq!(top_k(&[1.0, 2.0], 5).len(), 2);
        let batch = HostTensor::new(vec![2, 3], vec![0.0, 1.0, 2.0, 5.0, 4.0, 3.0]);
        let b = top_k_batch(&batch, 1);
        assert_eq!((b[0][0].class, b[1][0].class), (2, 0));
        assert_eq!(b[0][0].name(&["a", "b", "c"]), "c");
        assert_eq!(b[0][0].name(&[]), "class 2");
    }
}
