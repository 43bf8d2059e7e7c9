//! `kiln calibrate`: records activation ranges of a model over a calibration set on the CPU
//! executor and writes the JSON calibration cache that `--int8` / `--fp8` builds read
//! (`--calibration-cache`), so later builds need no data.
//!
//! The set is a safetensors file (`input` `[N, 3, S, S]`, or its only tensor; `[N, 1, S, S]` is
//! repeated over 3 channels) or a folder of images (JPEG, PNG, BMP, GIF, WebP, PGM/PPM, TIFF;
//! sorted by name). An image of exactly S×S is scaled to [0, 1] and normalised with `--mean` /
//! `--std`; any other size gets the model's preprocessing (`kiln run --image`'s): a classifier's
//! Resize and CenterCrop (then `--mean` / `--std`), a detector's letterbox.

use super::common;
use super::images;
use super::ModelArgs;
use clap::Args;
use kiln::engine::{CalibrationMethod, Calibrator, QuantFormat};
use kiln::{Error, HostTensor, Result};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The calibration set: a safetensors file, or a folder of images (JPEG, PNG, PGM/PPM, ...).
    #[arg(long, value_name = "PATH")]
    pub data: PathBuf,
    /// Use the first N images of the set (default: all).
    #[arg(long, value_name = "N")]
    pub images: Option<usize>,
    /// Images per CPU run.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// mse (the default: the least squared error per format, Model Optimizer's; chosen on held-out photos, docs/QUANT.md), percentile (99.99), percentile=P, entropy (TensorRT's KL divergence), or minmax.
    #[arg(long, default_value = "mse")]
    pub method: String,
    /// Per-channel mean subtracted from a classifier's images read from a folder (after scaling to [0, 1]).
    #[arg(long, value_delimiter = ',', default_value = "0.485,0.456,0.406")]
    pub mean: Vec<f32>,
    /// Per-channel standard deviation images read from a folder are divided by.
    #[arg(long, value_delimiter = ',', default_value = "0.229,0.224,0.225")]
    pub std: Vec<f32>,
    /// Where to write the cache (default: <model>.calib.json).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Read a truncated JPEG of a --data folder as it is, with a warning (its missing rows come
    /// out grey), instead of refusing it.
    #[arg(long)]
    pub accept_truncated_images: bool,
    /// Write no input means: an FP8 engine's layers then keep their biases as they are, instead
    /// of corrected for the mean shift their rounded weights cause (the default, which takes a
    /// ResNet-50's FP8 error against FP32 from 5.0e-2 to 1.9e-2 rel L2, docs/QUANT.md; INT8
    /// engines never correct).
    #[arg(long)]
    pub no_bias_correction: bool,
    /// After calibrating, measure which layers cost the int8 or fp8 engine its accuracy: the CPU
    /// simulation's rel L2 against FP32 with everything quantised, then with each quantised layer,
    /// and each module holding from two to a quarter of them, kept in FP16 (as `--layer-precisions <scope>:fp16`
    /// builds it). One simulation per scope over --sensitivity-images images: minutes for a
    /// ResNet-50.
    #[arg(long, value_name = "FORMAT", value_parser = ["int8", "fp8"])]
    pub sensitivity: Option<String>,
    /// Images of the set the sensitivity is measured on (the first N).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub sensitivity_images: usize,
}

pub fn calibrate(a: CalibrateArgs) -> Result<ExitCode> {
    let method = CalibrationMethod::parse(&a.method)?;
    if a.batch == 0 {
        return Err(Error::Flag { flag: "--batch".into(), reason: "must be at least 1".into() });
    }
    // `--batch` here is images per CPU run, not the model's: the graph runs at any batch.
    let traced = common::trace_args(&a.model, None)?;
    let [size, width] = traced.nchw_hw("kiln calibrate")?;
    if size != width {
        return Err(Error::Flag {
            flag: "--data".into(),
            reason: format!("calibration reads square images; {} takes {}", traced.name, traced.hw_text()),
        });
    }
    let images = if a.data.is_dir() { read_folder(&a, &traced, size)? } else { read_batch(&a.data, size)? };
    let n = a.images.unwrap_or(images.shape[0]).min(images.shape[0]);
    if n == 0 {
        return Err(Error::Flag { flag: "--data".into(), reason: format!("{} holds no images", a.data.display()) });
    }
    let batches = batches(&images, n, a.batch);
    let calibrator = Calibrator::new(&traced.graph)?.with_source(a.data.display().to_string());
    // Two passes over the set (ranges, then histograms), one CPU run per batch each.
    let bar = common::progress_bar(2 * batches.len(), &format!("calibrating {} on {n} image(s)", traced.name));
    let stats = calibrator.collect_with_progress(&batches, |done| bar.set_position(done as u64));
    bar.finish_and_clear();
    let mut cache = stats?.cache(method);
    if a.no_bias_correction {
        cache.input_means.clear();
    }
    let out = a.output.unwrap_or_else(|| PathBuf::from(format!("{}.calib.json", traced.name)));
    cache.save(&out)?;
    let bias = match cache.input_means.len() {
        0 => "no bias correction".to_string(),
        layers => format!("input means of {layers} layer(s) for bias correction"),
    };
    say!("calibrated {} ({method:?}) on {n} image(s) of {}: {} tensors, {bias}", traced.name, a.data.display(), cache.tensors.len());
    for (name, r) in &cache.tensors {
        say!("  {name:<40} amax {:>10.5}  int8 scale {:.6e}  fp8 scale {:.6e}", r.amax, r.int8_scale, r.fp8_scale);
    }
    say!("wrote {} (graph {}); build with --int8 or --fp8 --calibration-cache {}", out.display(), cache.graph_hash, out.display());
    if let Some(format) = &a.sensitivity {
        sensitivity(&traced, &cache, format, &images, n.min(a.sensitivity_images), a.batch)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The first `n` images of `images` (`[N, ...]`) in runs of at most `batch`.
fn batches(images: &HostTensor, n: usize, batch: usize) -> Vec<HostTensor> {
    let per = images.numel() / images.shape[0];
    let dims = &images.shape[1..];
    (0..n)
        .step_by(batch)
        .map(|start| {
            let end = (start + batch).min(n);
            HostTensor::new([&[end - start], dims].concat(), images.data[start * per..end * per].to_vec())
        })
        .collect()
}

/// `--sensitivity`: the scopes whose FP16 helps the `format` simulation most, and the rule to
/// build with.
fn sensitivity(
    traced: &common::Traced,
    cache: &kiln::engine::CalibrationCache,
    format: &str,
    images: &HostTensor,
    n: usize,
    batch: usize,
) -> Result<()> {
    let format = if format == "fp8" { QuantFormat::Fp8E4m3 } else { QuantFormat::Int8 };
    if n == 0 {
        return Err(Error::Flag { flag: "--sensitivity-images".into(), reason: "must be at least 1".into() });
    }
    let batches = batches(images, n, batch);
    let name = format.name().to_uppercase();
    let bar = common::progress_bar(0, &format!("{name} sensitivity of {} on {n} image(s)", traced.name));
    let result = kiln::engine::quant_sensitivity(&traced.graph, cache, format, &batches, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let (all, scopes) = result?;
    say!("{name} simulation against FP32 on {n} image(s): rel L2 {all:.3e} with every layer quantised; with one scope in FP16:");
    say!("  {:>10}  {:>6}  scope", "rel L2", "layers");
    for s in scopes.iter().take(15) {
        say!("  {:>10.3e}  {:>6}  {}", s.rel_l2, s.layers, s.scope);
    }
    if let Some(best) = scopes.first().filter(|b| b.rel_l2 < all) {
        say!(
            "keeping `{}` in FP16 ({} layer(s)) takes the error from {all:.3e} to {:.3e}: build with --layer-precisions {}:fp16",
            best.scope,
            best.layers,
            best.rel_l2,
            best.scope
        );
    }
    Ok(())
}

/// `[N, 3, S, S]` from a folder of images: each at S×S as it is (normalised by `--mean` / `--std`),
/// else through the model's preprocessing.
fn read_folder(a: &CalibrateArgs, traced: &common::Traced, size: usize) -> Result<HostTensor> {
    kiln::image::pnm::check_normalisation(&a.mean, &a.std)?;
    let (mean, std) = ([a.mean[0], a.mean[1], a.mean[2]], [a.std[0], a.std[1], a.std[2]]);
    let files = images::folder_images(&a.data, a.images)?;
    let mut prep = None;
    let mut data = Vec::new();
    for f in &files {
        let truncated = if a.accept_truncated_images { kiln_vision::Truncated::Accept } else { kiln_vision::Truncated::Refuse };
        let img = images::read_image(f, truncated)?;
        let x = if img.dimensions() == (size as u32, size as u32) {
            kiln_vision::to_nchw(&[img], mean, std).map_err(|e| Error::Image { path: f.clone(), reason: e.to_string() })?
        } else {
            if prep.is_none() {
                let mut p = images::Preprocess::of(traced, "--data")?;
                p.classify.mean = mean;
                p.classify.std = std;
                prep = Some(p);
            }
            let p = prep.as_ref().expect("set above");
            p.image(&img)
                .map_err(|e| match e {
                    Error::Image { reason, .. } => Error::Image { path: f.clone(), reason },
                    e => e,
                })?
                .0
        };
        data.try_reserve(x.data.len())
            .map_err(|_| Error::OutOfMemory { what: format!("{} images of {}", files.len(), a.data.display()), bytes: data.len() * 8 })?;
        data.extend_from_slice(&x.data);
    }
    HostTensor::try_new(vec![files.len(), 3, size, size], data)
}

/// `[N, 3, S, S]` from a safetensors file (`[N, 1, S, S]` repeated over 3 channels).
fn read_batch(path: &Path, size: usize) -> Result<HostTensor> {
    let x = common::read_input(path)?;
    match x.shape.as_slice() {
        [_, 3, h, w] if *h == size && *w == size => Ok(x),
        [n, 1, h, w] if *h == size && *w == size => {
            let plane = h * w;
            let data = x.data.chunks_exact(plane).flat_map(|p| p.iter().chain(p).chain(p).copied()).collect();
            Ok(HostTensor::new(vec![*n, 3, size, size], data))
        }
        s => Err(Error::Binding {
            name: "input".into(),
            reason: format!("{} holds shape {s:?}; the model takes [N, 3, {size}, {size}] (or [N, 1, {size}, {size}])", path.display()),
        }),
    }
}
