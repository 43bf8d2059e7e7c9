//! The attention ops' GPU candidates against the CPU executor, each forced through
//! `tactic_sources`, plus the timed choice: FP32 and FP16, batch 1 to 3, odd lengths (ViT's 197
//! tokens, Swin's 49-position windows), with and without a constant bias (Swin's relative position
//! bias + shifted-window mask).
//! - `attention` (q, k, v apart): cuBLASLt batched GEMMs + our softmax kernel, our fused kernel on
//!   CUDA cores, and (FP16) its tensor-core twins (K and V streamed in tiles, or resident);
//! - `qkv_attention` (packed `[.., L, 3·H·D]`, heads concatenated out): the two fused kernels
//!   reading q, k and v in place, and the unpacked cuBLASLt fallback (any head dim).
//!
//! Also `roll` (Swin's cyclic shift) and a Swin block through `common::check`.
//!
//! On the device: `cargo test --release --test gpu_attention -- --include-ignored --nocapture --test-threads 1`.

use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::{Graph, HostTensor, Param, Tracer};
use std::sync::Arc;

mod common;
use common::{check, gpu, random, rel_l2, BATCHES};

/// A tactic source to force (`None`: the timed choice) and whether only FP16 engines have it.
type Source = (Option<&'static str>, bool);

/// The sources of an attention layer: the timed choice, the cuBLASLt path (`gemm`, the kind's
/// prefix), and the fused kernels where the head dim has them (the tensor-core ones, K and V
/// streamed or resident, in FP16 only; a block over all `l` query rows where they exceed 64).
fn sources(gemm: &'static str, fused: bool, l: usize) -> Vec<Source> {
    let mut s = vec![(None, false), (Some(gemm), false)];
    if fused {
        s.extend([(Some("kernel:flash_attn_d"), false), (Some("kernel:flash_attn_tc_"), true)]);
        s.push((Some("kernel:flash_attn_tcs_q64"), true));
        if l > 64 {
            s.push((Some("kernel:flash_attn_tcs_qall"), true));
        }
    }
    s
}

/// Builds `graph` with each source forced (FP32 at `tol32`, FP16 at 1e-2) and compares output `y`
/// with the CPU executor at every batch, on fresh inputs of the given per-image shapes.
fn run_sources(name: &str, graph: &Graph, inputs: &[(&str, &[usize])], sources: &[Source], tol32: f64) {
    let Some(gpu) = gpu() else { return };
    for &(source, fp16_only) in sources {
        for (precision, tol) in [(Precision::Fp32, tol32), (Precision::Fp16, 1e-2)] {
            if fp16_only && precision != Precision::Fp16 {
                continue;
            }
            let mut config = BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false);
            if let Some(s) = source {
                config = config.tactic_sources(&[s]);
            }
            let engine =
                Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(graph).unwrap_or_else(|e| panic!("{name}: build: {e}")));
            let kind: Vec<String> = engine.layers().map(|l| l.kind()).filter(|k| k.contains("attn") || k.contains("attention")).collect();
            assert!(!kind.is_empty(), "{name}: no attention layer in the engine");
            if let Some(s) = source {
                assert!(kind.iter().all(|k| k.starts_with(s)), "{name}: forced {s}, got {kind:?}");
            }
            let mut ctx = engine.context().expect("context");
            for batch in [1, 2, 3] {
                let seed = name.bytes().fold(batch as u64 * 7919, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
                let values: Vec<HostTensor> =
                    inputs.iter().enumerate().map(|(i, (_, s))| random(&[&[batch][..], s].concat(), seed + i as u64, 1.0)).collect();
                let bound: Vec<(&str, &HostTensor)> = inputs.iter().map(|(n, _)| *n).zip(&values).collect();
                let want = kiln::run_cpu(graph, &bound).expect("cpu");
                let got = ctx.run(&bound).unwrap_or_else(|e| panic!("{name} {precision:?} batch {batch}: {e}"));
                let (rel, max_abs) = rel_l2(&got["y"].data, &want["y"].data);
                println!(
                    "{name:<36} {:<28} {precision:?} batch {batch} {:?}: rel L2 {rel:.2e}, max abs {max_abs:.2e} ({kind:?})",
                    source.unwrap_or("timed"),
                    want["y"].shape
                );
                assert!(rel <= tol, "{name} {source:?} {precision:?} batch {batch}: rel L2 {rel:.3e} > {tol:e}");
            }
        }
    }
}

/// `attention` over inputs q `[1, ..q]`, k and v `[1, ..kv]`, optionally with a constant bias,
/// through every candidate.
fn check_candidates(name: &str, q: &[usize], kv: &[usize], bias: Option<&Param>, fused: bool) {
    let tracer = Tracer::new();
    let full = |s: &[usize]| [&[1usize][..], s].concat();
    let (tq, tk, tv) = (tracer.input("q", &full(q)), tracer.input("k", &full(kv)), tracer.input("v", &full(kv)));
    let y = match bias {
        Some(b) => tq.attention_weight("attn", &tk, &tv, b, None),
        None => tq.attention(&tk, &tv, None, None),
    }
    .expect("trace");
    tracer.output("y", &y);
    run_sources(name, &tracer.graph(), &[("q", q), ("k", kv), ("v", kv)], &sources("cublaslt-attention", fused, q[q.len() - 2]), 1e-5);
}

/// `qkv_attention` over a packed input `[1, ..qkv]` with `heads` heads, optionally with a constant
/// bias, through every candidate its head dim has.
fn check_packed(name: &str, qkv: &[usize], heads: usize, bias: Option<&Param>) {
    let tracer = Tracer::new();
    let x = tracer.input("qkv", &[&[1usize][..], qkv].concat());
    let y = match bias {
        Some(b) => x.qkv_attention_weight("attn", heads, b, None),
        None => x.qkv_attention(heads, None, None),
    }
    .expect("trace");
    tracer.output("y", &y);
    let d = qkv[qkv.len() - 1] / (3 * heads);
    let fused = matches!(d, 32 | 64);
    run_sources(name, &tracer.graph(), &[("qkv", qkv)], &sources("cublaslt-attention:unpacked", fused, qkv[qkv.len() - 2]), 1e-4);
}

/// Swin's stage-1 bias for 4 windows of a 14×14 map: a random relative position bias per head
/// plus the shifted-window mask (0 / -100), `[windows, heads, 49, 49]`.
fn swin_bias(heads: usize) -> Param {
    let mask = kiln_models::swin::shifted_window_mask(14, 14, 7, 3);
    let rel = random(&[heads, 49, 49], 99, 0.5);
    let mut data = Vec::with_capacity(4 * heads * 49 * 49);
    for m in mask.chunks_exact(49 * 49) {
        for r in rel.data.chunks_exact(49 * 49) {
            data.extend(r.iter().zip(m).map(|(a, b)| a + b));
        }
    }
    Param { name: "attn.bias".into(), value: Arc::new(HostTensor::new(vec![4, heads, 49, 49], data)) }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn vit_attention_197_tokens() {
    check_candidates("vit 12 heads L197 d64", &[12, 197, 64], &[12, 197, 64], None, true);
    check_candidates("cross L17 S33 d32", &[3, 17, 32], &[3, 33, 32], None, true);
    // 80 keys: a tile of 64 and one of 16, neither masked (in the resident kernel).
    check_candidates("cross L20 S80 d64", &[2, 20, 64], &[2, 80, 64], None, true);
    // 300 query rows: a block over all of them gives each warp 5 tiles, the last partly past L.
    check_candidates("cross L300 S45 d32", &[2, 300, 32], &[2, 45, 32], None, true);
    check_candidates("head dim 40 (cuBLASLt only)", &[2, 19, 40], &[2, 19, 40], None, false);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn swin_window_attention_with_bias_and_mask() {
    let rel = Param { name: "attn.rel".into(), value: Arc::new(random(&[3, 49, 49], 98, 0.5)) };
    check_candidates("swin windows, rel bias", &[4, 3, 49, 32], &[4, 3, 49, 32], Some(&rel), true);
    check_candidates("swin windows, bias + mask", &[4, 3, 49, 32], &[4, 3, 49, 32], Some(&swin_bias(3)), true);
}

/// ViT-B/16's packed attention: `in_proj`'s `[197, 2304]` rows, 12 heads of 64.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn packed_vit_attention_197_tokens() {
    check_packed("packed vit 12 heads L197 d64", &[197, 2304], 12, None);
    check_packed("packed 4 heads L70 d32", &[70, 384], 4, None);
}

/// Swin-T's stage-1 packed window attention: `[4 windows, 49, 288]`, 3 heads of 32, with the
/// relative position bias alone and with the shifted-window mask added.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn packed_swin_window_attention_with_bias_and_mask() {
    let rel = Param { name: "attn.rel".into(), value: Arc::new(random(&[3, 49, 49], 98, 0.5)) };
    check_packed("packed swin windows, rel bias", &[4, 49, 288], 3, Some(&rel));
    check_packed("packed swin windows, bias + mask", &[4, 49, 288], 3, Some(&swin_bias(3)));
}

/// A head dim the fused kernels are not stamped for (40): the unpacked cuBLASLt candidate alone,
/// without and with groups and a bias.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn packed_attention_head_dim_40_unpacked() {
    check_packed("packed 2 heads L19 d40", &[19, 240], 2, None);
    let bias = Param { name: "attn.bias".into(), value: Arc::new(random(&[3, 2, 19, 19], 97, 0.5)) };
    check_packed("packed 3 groups 2 heads L19 d40 bias", &[3, 19, 240], 2, Some(&bias));
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn roll() {
    check("roll -3,-3 dims 1,2 of [7, 9, 5]", &[("x", &[7, 9, 5])], |x| Ok(vec![x[0].roll(&[-3, -3], &[1, 2])?]));
    check("roll 11,-2 of [4, 5, 6]", &[("x", &[4, 5, 6])], |x| Ok(vec![x[0].roll(&[11, -2], &[3, 1])?]));
    check("roll of an NHWC conv output", &[("x", &[3, 8, 8])], |x| {
        use kiln::{Forward, Module};
        let conv = kiln::nn::Conv2d::load(kiln::VarBuilder::seeded().pp("conv"), &kiln::nn::Conv2dConfig::new(3, 6, 3).padding(1))?;
        Ok(vec![conv.forward(&x[0])?.roll(&[2, -1], &[2, 3])?])
    });
}

/// Swin's window attention block end to end on small inputs (partition, qkv, attention with the
/// shifted mask, reverse, roll back), traced as a whole model stage.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn swin_block_end_to_end() {
    use kiln::{Forward, Module};
    check("swin block dim 96 heads 3 on 14x14, shifted", &[("x", &[14, 14, 96])], |x| {
        let b = kiln_models::swin::SwinTransformerBlock::load(kiln::VarBuilder::seeded().pp("blk"), &(96, 3, 7, 3))?;
        Ok(vec![b.forward(&x[0])?])
    });
}

/// A ViT encoder block end to end (LayerNorm, in_proj, packed attention, out_proj, MLP), narrowed
/// to 256 wide with 8 heads of 32 to keep the CPU reference quick.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn vit_block_end_to_end() {
    use kiln::{Forward, Module};
    check("vit block width 256 heads 8 on 197 tokens", &[("x", &[197, 256])], |x| {
        let c = kiln_models::vit::VitConfig { hidden: 256, heads: 8, mlp: 512, ..kiln_models::vit::VitConfig::vit_b_16() };
        let b = kiln_models::vit::EncoderBlock::load(kiln::VarBuilder::seeded().pp("blk"), &c)?;
        Ok(vec![b.forward(&x[0])?])
    });
}

/// `matmul` of two activations with the same leading dims through the forced strided-batched
/// cuBLASLt candidate and the forced tiled kernel (attention written as matmuls, as PyTorch code
/// often is), against the CPU executor.
#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn batched_matmul_candidates() {
    let Some(gpu) = gpu() else { return };
    let (a, b) = ([3usize, 17, 40], [3usize, 40, 9]);
    let tracer = Tracer::new();
    let full = |s: &[usize]| [&[1usize][..], s].concat();
    let (ta, tb) = (tracer.input("a", &full(&a)), tracer.input("b", &full(&b)));
    tracer.output("y", &ta.matmul(&tb).expect("trace"));
    let graph = tracer.graph();
    for source in ["cublaslt-batched-gemm", "kernel:matmul_tiled"] {
        for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Fp16, 1e-2)] {
            let config = BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false).tactic_sources(&[source]);
            let engine =
                Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).unwrap_or_else(|e| panic!("{source}: build: {e}")));
            let kinds: Vec<String> = engine.layers().map(|l| l.kind()).filter(|k| k.contains("matmul") || k.contains("gemm")).collect();
            assert!(kinds.iter().all(|k| k.starts_with(source)) && !kinds.is_empty(), "forced {source}, got {kinds:?}");
            let mut ctx = engine.context().expect("context");
            for batch in BATCHES {
                let shape = |s: &[usize]| [&[batch][..], s].concat();
                let (ha, hb) = (random(&shape(&a), 11 + batch as u64, 1.0), random(&shape(&b), 13 + batch as u64, 1.0));
                let bound = [("a", &ha), ("b", &hb)];
                let want = kiln::run_cpu(&graph, &bound).expect("cpu");
                let got = ctx.run(&bound).unwrap_or_else(|e| panic!("{source} {precision:?} batch {batch}: {e}"));
                let (rel, max_abs) = rel_l2(&got["y"].data, &want["y"].data);
                println!("matmul {a:?} @ {b:?} {source:<22} {precision:?} batch {batch}: rel L2 {rel:.2e}, max abs {max_abs:.2e}");
                assert!(rel <= tol, "{source} {precision:?} batch {batch}: rel L2 {rel:.3e} > {tol:e}");
            }
        }
    }
}
