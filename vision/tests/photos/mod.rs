//! The photo set of the 8-bit checks (`quant_photos.rs` on the CPU, `gpu_quant_photos.rs` on the
//! GPU): torchvision's trained MobileNetV2 on the scikit-image photos, their views, the two folds,
//! and how a quantised run agrees with FP32.
#![allow(dead_code)]

use kiln::dev::quant::simulate_with_rules;
use kiln::engine::{CalibrationCache, CalibrationMethod, Calibrator, LayerPrecision, QuantFormat};
use kiln::{Graph, HostTensor, VarBuilder};
use kiln_vision::image::imageops;
use kiln_vision::{center_crop, load_rgb, resize_shorter, top_k, ClassifyPreset, RgbImage};
use std::path::{Path, PathBuf};

pub const CHECKPOINT: &str = "mobilenet_v2-b0353104.pth";
/// The photos of `tools/fetch_real_data.py`, in its order.
pub const PHOTOS: [&str; 12] = [
    "chelsea.png",
    "coffee.png",
    "astronaut.png",
    "rocket.jpg",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "hubble_deep_field.jpg",
    "retina.jpg",
    "ihc.png",
    "color.png",
    "camera.png",
    "horse.png",
];
/// Views of each photo: the first is the judged centre crop.
pub const VIEWS: usize = 4;

/// The calibration method: `$KILN_METHOD` (a `--method` value), else the default.
pub fn method_from_env() -> CalibrationMethod {
    std::env::var("KILN_METHOD").ok().map_or(CalibrationMethod::default(), |m| CalibrationMethod::parse(&m).expect("KILN_METHOD"))
}

/// Layers kept out of 8 bits in the judged engines and simulations: `$KILN_LAYER_PRECISIONS` (a
/// `--layer-precisions` value, e.g. `features.0.0:fp16`), else none.
pub fn rules_from_env() -> Vec<LayerPrecision> {
    std::env::var("KILN_LAYER_PRECISIONS").ok().map_or(vec![], |r| LayerPrecision::parse_list(&r).expect("KILN_LAYER_PRECISIONS"))
}

pub fn real_data() -> Option<PathBuf> {
    let dir = std::env::var_os("KILN_REAL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/real-data"));
    if dir.join(CHECKPOINT).is_file() && PHOTOS.iter().all(|p| dir.join("photos").join(p).is_file()) {
        return Some(dir);
    }
    let reason =
        format!("no {CHECKPOINT} and photos/ in {} (run `python3 tools/fetch_real_data.py`, or set KILN_REAL_DATA)", dir.display());
    assert!(std::env::var_os("KILN_REQUIRE_REAL_DATA").is_none(), "KILN_REQUIRE_REAL_DATA is set, but there is {reason}");
    println!("SKIPPED: {reason}");
    None
}

/// The photos' views, `[VIEWS × 12, 3, 224, 224]` as one tensor per photo (`[VIEWS, 3, 224, 224]`).
pub struct Data {
    pub graph: Graph,
    pub views: Vec<HostTensor>,
}

pub fn load(dir: &Path) -> Data {
    let vb = VarBuilder::from_files(&[dir.join(CHECKPOINT)]).expect("the checkpoint reads");
    let graph = kiln_models::trace("mobilenet_v2", vb, 1, 224).expect("mobilenet_v2 loads the checkpoint");
    let preset = ClassifyPreset::IMAGENET;
    let views = PHOTOS
        .iter()
        .map(|p| {
            let img = load_rgb(dir.join("photos").join(p)).expect("decode");
            let centre = preset.crop(&img);
            let closer = center_crop(&resize_shorter(&img, 288), 224, 224);
            let views: [RgbImage; VIEWS] =
                [centre.clone(), imageops::flip_horizontal(&centre), closer.clone(), imageops::flip_horizontal(&closer)];
            kiln_vision::to_nchw(&views, preset.mean, preset.std).expect("batch")
        })
        .collect();
    Data { graph, views }
}

/// The photos of fold `f` (0: even positions, 1: odd).
pub fn fold(f: usize) -> impl Iterator<Item = usize> {
    (f..PHOTOS.len()).step_by(2)
}

/// `[n, 3, 224, 224]`: the first `views` views of each photo in `photos`.
pub fn batch(data: &Data, photos: impl Iterator<Item = usize>, views: usize) -> HostTensor {
    let per = 3 * 224 * 224;
    let mut out = Vec::new();
    let mut n = 0;
    for p in photos {
        out.extend_from_slice(&data.views[p].data[..views * per]);
        n += views;
    }
    HostTensor::new(vec![n, 3, 224, 224], out)
}

pub fn logits(graph: &Graph, x: &HostTensor) -> HostTensor {
    let mut out = kiln::run_cpu(graph, &[("input", x)]).expect("cpu run");
    out.remove("logits").expect("logits")
}

/// How a quantised run agrees with FP32 over the judged images.
#[derive(Default, Debug, Clone, Copy)]
pub struct Agreement {
    pub images: usize,
    pub top1: usize,
    pub top5: usize,
    pub worst_rel_l2: f64,
    pub sum_rel_l2: f64,
}

/// Per image of `[n, 1000]` logits: the rel L2 of `got` against `want`.
pub fn rel_l2_per_image(got: &HostTensor, want: &HostTensor) -> Vec<f64> {
    got.data
        .chunks(1000)
        .zip(want.data.chunks(1000))
        .map(|(g, w)| kiln::compare("logits", &HostTensor::new(vec![1000], g.to_vec()), &HostTensor::new(vec![1000], w.to_vec())).rel_l2)
        .collect()
}

impl Agreement {
    pub fn add(&mut self, got: &HostTensor, fp32: &HostTensor) {
        let rel_l2 = rel_l2_per_image(got, fp32);
        for ((g, r), e) in got.data.chunks(1000).zip(fp32.data.chunks(1000)).zip(rel_l2) {
            let (gk, rk) = (top_k(g, 5), top_k(r, 5));
            self.images += 1;
            self.top1 += usize::from(gk[0].class == rk[0].class);
            self.top5 += gk.iter().filter(|p| rk.iter().any(|q| q.class == p.class)).count();
            self.worst_rel_l2 = self.worst_rel_l2.max(e);
            self.sum_rel_l2 += e;
        }
    }
    pub fn text(&self) -> String {
        format!(
            "{}/{} | {}/{} | {:.3} | {:.3}",
            self.top1,
            self.images,
            self.top5,
            5 * self.images,
            self.sum_rel_l2 / self.images.max(1) as f64,
            self.worst_rel_l2
        )
    }
}

/// Each fold's calibration statistics (recorded on its photos' views), once.
pub fn fold_stats(data: &Data) -> [kiln::engine::CalibrationStats; 2] {
    let calibrator = Calibrator::new(&data.graph).expect("calibrator");
    [0, 1].map(|f| calibrator.collect(&[batch(data, fold(f), VIEWS)]).expect("calibration"))
}

/// Runs `method` × `format` with each fold's cache on the other fold: (centre crops, all views).
/// The layers `$KILN_LAYER_PRECISIONS` covers stay out of 8 bits.
pub fn judge(
    data: &Data,
    caches: &[CalibrationCache; 2],
    format: QuantFormat,
    fp32: &[(HostTensor, HostTensor); 2],
) -> (Agreement, Agreement) {
    judge_with_rules(data, caches, format, fp32, &rules_from_env())
}

/// [`judge`] with the layers `rules` covers out of 8 bits.
pub fn judge_with_rules(
    data: &Data,
    caches: &[CalibrationCache; 2],
    format: QuantFormat,
    fp32: &[(HostTensor, HostTensor); 2],
    rules: &[LayerPrecision],
) -> (Agreement, Agreement) {
    let (mut centre, mut all) = (Agreement::default(), Agreement::default());
    for (f, cache) in caches.iter().enumerate() {
        let judged = 1 - f;
        let sim = simulate_with_rules(&data.graph, cache, format, rules).expect("simulation graph");
        let got = logits(&sim, &batch(data, fold(judged), VIEWS));
        all.add(&got, &fp32[judged].1);
        let per = 1000 * VIEWS;
        let centre_got: Vec<f32> = got.data.chunks(per).flat_map(|c| c[..1000].to_vec()).collect();
        centre.add(&HostTensor::new(vec![centre_got.len() / 1000, 1000], centre_got), &fp32[judged].0);
    }
    (centre, all)
}

/// FP32's logits on each fold: (centre crops, all views).
pub fn fp32_logits(data: &Data) -> [(HostTensor, HostTensor); 2] {
    [0, 1].map(|f| {
        let all = logits(&data.graph, &batch(data, fold(f), VIEWS));
        let centre: Vec<f32> = all.data.chunks(1000 * VIEWS).flat_map(|c| c[..1000].to_vec()).collect();
        (HostTensor::new(vec![centre.len() / 1000, 1000], centre), all)
    })
}
