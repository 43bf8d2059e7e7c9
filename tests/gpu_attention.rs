//! The attention op's two GPU candidates (cuBLASLt batched GEMMs + our softmax kernel, and our
//! fused kernel), each forced through `tactic_sources`, plus the timed choice, against the CPU
//! executor: FP32 and FP16, batch 1 and 3, odd lengths (ViT's 197 tokens, Swin's 49-position
//! windows), with and without a constant bias (Swin's relative position bias + shifted-window mask).
//! Also `roll` (Swin's cyclic shift) through `common::check`.
//!
//! On the device: `cargo test --release --test gpu_attention -- --include-ignored --nocapture --test-threads 1`.

use kiln::engine::{BuildConfig, EngineBuilder, Precision};
use kiln::{HostTensor, Param, Tracer};
use std::sync::Arc;

mod common;
use common::{check, gpu, random, rel_l2, BATCHES};

/// A traced attention over inputs q `[1, ..q]`, k and v `[1, ..kv]`, optionally with a constant bias.
fn trace(q: &[usize], kv: &[usize], bias: Option<&Param>) -> kiln::Graph {
    let tracer = Tracer::new();
    let full = |s: &[usize]| [&[1usize][..], s].concat();
    let (tq, tk, tv) = (tracer.input("q", &full(q)), tracer.input("k", &full(kv)), tracer.input("v", &full(kv)));
    let y = match bias {
        Some(b) => tq.attention_weight("attn", &tk, &tv, b, None),
        None => tq.attention(&tk, &tv, None, None),
    }
    .expect("trace");
    tracer.output("y", &y);
    tracer.graph()
}

/// Builds the graph with each candidate forced (and with the timed choice) and compares it with
/// the CPU executor at every batch.
fn check_candidates(name: &str, q: &[usize], kv: &[usize], bias: Option<&Param>, fused: bool) {
    let Some(gpu) = gpu() else { return };
    let graph = trace(q, kv, bias);
    let mut sources: Vec<Option<&str>> = vec![None, Some("cublaslt-attention")];
    if fused {
        // The CUDA-core kernel (any precision) and the tensor-core one (f16 only).
        sources.extend([Some("kernel:flash_attn_d"), Some("kernel:flash_attn_tc")]);
    }
    for source in sources {
        for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Fp16, 1e-2)] {
            if source == Some("kernel:flash_attn_tc") && precision == Precision::Fp32 {
                continue;
            }
            let mut config = BuildConfig::default().precision(precision).batch(1, 3, 3).cuda_graphs(false);
            if let Some(s) = source {
                config = config.tactic_sources(&[s]);
            }
            let engine =
                Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).unwrap_or_else(|e| panic!("{name}: build: {e}")));
            let kind: Vec<String> = engine.layers().map(|l| l.kind()).filter(|k| k.contains("attn") || k.contains("attention")).collect();
            assert!(!kind.is_empty(), "{name}: no attention layer in the engine");
            if let Some(s) = source {
                assert!(kind.iter().all(|k| k.starts_with(s)), "{name}: forced {s}, got {kind:?}");
            }
            let mut ctx = engine.context().expect("context");
            for batch in BATCHES {
                let seed = name.bytes().fold(batch as u64 * 7919, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
                let shape = |s: &[usize]| [&[batch][..], s].concat();
                let (hq, hk, hv) = (random(&shape(q), seed, 1.0), random(&shape(kv), seed + 1, 1.0), random(&shape(kv), seed + 2, 1.0));
                let bound = [("q", &hq), ("k", &hk), ("v", &hv)];
                let want = kiln::cpu::run(&graph, &bound).expect("cpu");
                let got = ctx.run(&bound).unwrap_or_else(|e| panic!("{name} {precision:?} batch {batch}: {e}"));
                let (rel, max_abs) = rel_l2(&got["y"].data, &want["y"].data);
                println!(
                    "{name:<28} {:<20} {precision:?} batch {batch} {:?}: rel L2 {rel:.2e}, max abs {max_abs:.2e} ({kind:?})",
                    source.unwrap_or("timed"),
                    want["y"].shape
                );
                assert!(rel <= tol, "{name} {source:?} {precision:?} batch {batch}: rel L2 {rel:.3e} > {tol:e}");
            }
        }
    }
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
    check_candidates("head dim 40 (cuBLASLt only)", &[2, 19, 40], &[2, 19, 40], None, false);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn swin_window_attention_with_bias_and_mask() {
    let rel = Param { name: "attn.rel".into(), value: Arc::new(random(&[3, 49, 49], 98, 0.5)) };
    check_candidates("swin windows, rel bias", &[4, 3, 49, 32], &[4, 3, 49, 32], Some(&rel), true);
    check_candidates("swin windows, bias + mask", &[4, 3, 49, 32], &[4, 3, 49, 32], Some(&swin_bias(3)), true);
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn roll() {
    check("roll -3,-3 dims 1,2 of [7, 9, 5]", &[("x", &[7, 9, 5])], |x| Ok(vec![x[0].roll(&[-3, -3], &[1, 2])?]));
    check("roll 11,-2 of [4, 5, 6]", &[("x", &[4, 5, 6])], |x| Ok(vec![x[0].roll(&[11, -2], &[3, 1])?]));
    check("roll of an NHWC conv output", &[("x", &[3, 8, 8])], |x| {
        use kiln::{Forward, Module};
        let conv = kiln::Conv2d::load(kiln::VarBuilder::seeded().pp("conv"), &kiln::Conv2dConfig::new(3, 6, 3).padding(1))?;
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
                let want = kiln::cpu::run(&graph, &bound).expect("cpu");
                let got = ctx.run(&bound).unwrap_or_else(|e| panic!("{source} {precision:?} batch {batch}: {e}"));
                let (rel, max_abs) = rel_l2(&got["y"].data, &want["y"].data);
                println!("matmul {a:?} @ {b:?} {source:<22} {precision:?} batch {batch}: rel L2 {rel:.2e}, max abs {max_abs:.2e}");
                assert!(rel <= tol, "{source} {precision:?} batch {batch}: rel L2 {rel:.3e} > {tol:e}");
            }
        }
    }
}
