//! The Hopper wgmma GEMM (`kernels/hopper_gemm.cu`) run directly on random FP16 operands against
//! an f32 CPU reference: every tile, every fused activation, with and without bias and residual,
//! ragged M and N, and ViT-B/16's fc1 at batch 64 (12608 × 3072 × 768). Then its speed against
//! cuBLASLt on ViT-B/16's GEMMs, and a Linear engine forced onto it (tensor maps over arena
//! values, batches 1..3). Skips without a GPU, or on a GPU that is not sm_90.
//!
//! On the device: `gpu_hopper_gemm --include-ignored --nocapture --test-threads 1`.

use kiln::dev::hopper::{HopperAct, HopperGemm, HopperGrid, HopperTile};
use kiln::engine::{BuildConfig, EngineBuilder, Gpu, Precision};
use kiln::plugin::{DeviceBuf, Elem, Kernels, LtMatmul, RunCtx};
use kiln::{Graph, Tensor, Tracer};
use std::sync::Arc;
use std::time::Instant;

mod common;
use common::{gpu, random, rel_l2};

/// FP16 outputs of a K ≤ 3072 GEMM: the bound the task sets (f16 rounding of D is ~3e-4).
const REL_L2_BOUND: f64 = 1e-2;

fn hopper_gpu() -> Option<Arc<Gpu>> {
    let gpu = gpu()?;
    if gpu.info.sm != 90 {
        println!("skipped: the wgmma GEMM needs an sm_90 GPU, this is sm_{}", gpu.info.sm);
        return None;
    }
    Some(gpu)
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()
}
fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect()
}

fn download_f16(gpu: &Gpu, buf: &DeviceBuf, count: usize) -> Vec<f32> {
    let mut out = vec![half::f16::ZERO; count];
    // SAFETY: `buf` holds at least `count` f16 values; the stream is synchronised before `out` is read.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut out, buf.ptr(), gpu.stream.cu_stream()) }.expect("download");
    gpu.stream.synchronize().expect("synchronise");
    out.iter().map(|v| v.to_f32()).collect()
}

/// `X · Wᵀ` in f32 for the rows `rows` (X `[m, k]`, W `[n, k]`), threaded over rows.
fn reference_products(x: &[f32], w: &[f32], k: usize, n: usize, rows: &[usize]) -> Vec<f32> {
    let mut out = vec![0f32; rows.len() * n];
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let per = rows.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (chunk, rs) in out.chunks_mut(per * n).zip(rows.chunks(per)) {
            s.spawn(move || {
                for (o, &r) in chunk.chunks_mut(n).zip(rs) {
                    let xr = &x[r * k..(r + 1) * k];
                    for (c, v) in o.iter_mut().enumerate() {
                        *v = xr.iter().zip(&w[c * k..(c + 1) * k]).map(|(a, b)| a * b).sum();
                    }
                }
            });
        }
    });
    out
}

fn act_reference(act: HopperAct, v: f32) -> f32 {
    use kiln::plugin::Unary;
    match act {
        HopperAct::None => v,
        HopperAct::Relu => Unary::Relu.apply(v),
        HopperAct::Gelu => Unary::Gelu { tanh: false }.apply(v),
        HopperAct::GeluTanh => Unary::Gelu { tanh: true }.apply(v),
        HopperAct::Silu => Unary::Silu.apply(v),
    }
}

/// Device operands of one problem and their f16-rounded host copies.
struct Problem {
    m: usize,
    n: usize,
    k: usize,
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
    res: Vec<f32>,
    dx: DeviceBuf,
    dw: DeviceBuf,
    dbias: DeviceBuf,
    dy: DeviceBuf,
}

impl Problem {
    fn new(gpu: &Gpu, m: usize, n: usize, k: usize, seed: u64) -> Self {
        let x = rounded(&random(&[m * k], seed, 1.0).data);
        let w = rounded(&random(&[n * k], seed + 1, 1.0 / (k as f32).sqrt()).data);
        let bias = random(&[n], seed + 2, 0.5).data;
        let res = rounded(&random(&[m * n], seed + 3, 1.0).data);
        let up = |b: &[u8]| DeviceBuf::from_bytes(&gpu.stream, b).expect("upload");
        let (dx, dw, dbias) = (up(&f16_bytes(&x)), up(&f16_bytes(&w)), up(&f32_bytes(&bias)));
        let dy = DeviceBuf::zeros(&gpu.stream, m * n * 2).expect("output");
        Self { m, n, k, x, w, bias, res, dx, dw, dbias, dy }
    }
}

/// Runs every tile × activation × (bias, residual) on `p`, checking the rows `rows` (all for
/// small problems) against the f32 reference.
fn check_problem(gpu: &Gpu, kernels: &Kernels, p: &Problem, rows: &[usize]) {
    let products = reference_products(&p.x, &p.w, p.k, p.n, rows);
    for (tile, grid) in HopperTile::ALL.into_iter().flat_map(|t| [(t, HopperGrid::PerTile), (t, HopperGrid::Persistent)]) {
        for act in HopperAct::ALL {
            for (with_bias, with_res) in [(false, false), (true, false), (true, true)] {
                // The residual is copied into Y and read there: the in-place form the layer uses.
                let y =
                    if with_res { DeviceBuf::from_bytes(&gpu.stream, &f16_bytes(&p.res)).expect("copy") } else { p.dy.clone_zeroed(gpu) };
                let gemm = HopperGemm::new("test", kernels, tile, grid, p.k, p.n, p.dw.ptr(), act).unwrap_or_else(|e| panic!("{e}"));
                let bias = if with_bias { p.dbias.ptr() } else { 0 };
                let res = if with_res { y.ptr() } else { 0 };
                gemm.enqueue(&gpu.stream, p.m, p.dx.ptr(), bias, res, y.ptr()).unwrap_or_else(|e| panic!("{e}"));
                let got_all = download_f16(gpu, &y, p.m * p.n);
                let (mut got, mut want) = (Vec::new(), Vec::new());
                for (i, &r) in rows.iter().enumerate() {
                    for c in 0..p.n {
                        let mut v = products[i * p.n + c];
                        if with_bias {
                            v += p.bias[c];
                        }
                        if with_res {
                            v += p.res[r * p.n + c];
                        }
                        want.push(act_reference(act, v));
                        got.push(got_all[r * p.n + c]);
                    }
                }
                let (rel, max_abs) = rel_l2(&got, &want);
                println!(
                    "wgmma {:>4}x{:<4}x{:<4} {:<31} {:<9} bias {:<5} residual {:<5}: rel L2 {rel:.2e}, max-abs {max_abs:.2e} ({} rows checked)",
                    p.m,
                    p.n,
                    p.k,
                    tile.kind(grid),
                    format!("{act:?}"),
                    with_bias,
                    with_res,
                    rows.len()
                );
                assert!(rel < REL_L2_BOUND && max_abs.is_finite(), "{tile:?} {act:?} {}x{}x{}: rel L2 {rel}", p.m, p.n, p.k);
            }
        }
    }
}

trait CloneZeroed {
    fn clone_zeroed(&self, gpu: &Gpu) -> DeviceBuf;
}
impl CloneZeroed for DeviceBuf {
    fn clone_zeroed(&self, gpu: &Gpu) -> DeviceBuf {
        DeviceBuf::zeros(&gpu.stream, self.len()).expect("output")
    }
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn wgmma_gemm_matches_the_f32_reference() {
    let Some(gpu) = hopper_gpu() else { return };
    let kernels = Kernels::new(&gpu).expect("kernels");
    // (M, N, K): one exact tile; ragged M, N and K (K a multiple of 8, not of 64); N odd (the
    // scalar stores); more K tiles than stages; tall and thin.
    let small: &[(usize, usize, usize)] =
        &[(128, 128, 64), (1, 8, 8), (200, 100, 72), (333, 520, 776), (130, 257, 40), (640, 384, 1024), (77, 3, 16)];
    let only_small = std::env::var("HOPPER_SMALL").is_ok_and(|v| v == "1");
    for (i, &(m, n, k)) in small.iter().enumerate() {
        let p = Problem::new(&gpu, m, n, k, 100 + 10 * i as u64);
        check_problem(&gpu, &kernels, &p, &(0..m).collect::<Vec<_>>());
    }
    if only_small {
        return;
    }
    // ViT-B/16 fc1 at batch 64: every 13th row and the last (the ragged last tile: 12608 = 98.5 · 128).
    let (m, n, k) = (197 * 64, 3072, 768);
    let p = Problem::new(&gpu, m, n, k, 7);
    let mut rows: Vec<usize> = (0..m).step_by(13).collect();
    rows.extend(m - 64..m);
    check_problem(&gpu, &kernels, &p, &rows);
}

/// Mean milliseconds of `f` over enough runs for ~50 ms, after a warm-up.
fn time_ms(gpu: &Gpu, mut f: impl FnMut()) -> f64 {
    f();
    gpu.stream.synchronize().expect("sync");
    let t = Instant::now();
    f();
    gpu.stream.synchronize().expect("sync");
    let once = t.elapsed().as_secs_f64();
    let iters = ((0.05 / once.max(1e-6)) as usize).clamp(5, 200);
    let t = Instant::now();
    for _ in 0..iters {
        f();
    }
    gpu.stream.synchronize().expect("sync");
    t.elapsed().as_secs_f64() * 1e3 / iters as f64
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn wgmma_gemm_speed_against_cublaslt() {
    let Some(gpu) = hopper_gpu() else { return };
    let kernels = Kernels::new(&gpu).expect("kernels");
    let ws = DeviceBuf::zeros(&gpu.stream, 32 << 20).expect("workspace");
    let rt = RunCtx { stream: &gpu.stream, handles: &gpu.handles, ptrs: &[], workspace: ws.ptr(), workspace_bytes: ws.len() };
    let m = 197 * 64;
    for (name, n, k) in [("fc1", 3072, 768), ("fc2", 768, 3072), ("qkv", 2304, 768), ("square", 4096, 4096)] {
        let m = if name == "square" { 4096 } else { m };
        let p = Problem::new(&gpu, m, n, k, 1);
        let flops = 2.0 * (m * n * k) as f64;
        let bias16 = DeviceBuf::from_bytes(&gpu.stream, &f16_bytes(&p.bias)).expect("bias");
        let lt = LtMatmul::new("lt", Precision::Fp16, Elem::F16, k, n, Some(&bias16), false).expect("cuBLASLt");
        lt.prepare(&rt, m, 1).expect("plan");
        let ms = time_ms(&gpu, || lt.enqueue(&rt, m, p.dx.ptr(), p.dw.ptr(), 0, p.dy.ptr()).expect("cuBLASLt"));
        println!("TIMING gemm {name} {m}x{n}x{k}: cublaslt+bias {ms:.4} ms, {:.0} TFLOP/s", flops / ms / 1e9);
        for (tile, grid) in HopperTile::ALL.into_iter().flat_map(|t| [(t, HopperGrid::PerTile), (t, HopperGrid::Persistent)]) {
            for act in [HopperAct::None, HopperAct::Gelu] {
                let g = HopperGemm::new("t", &kernels, tile, grid, k, n, p.dw.ptr(), act).expect("wgmma");
                let ms = time_ms(&gpu, || g.enqueue(&gpu.stream, m, p.dx.ptr(), p.dbias.ptr(), 0, p.dy.ptr()).expect("wgmma"));
                println!("TIMING gemm {name} {m}x{n}x{k}: {} bias+{act:?} {ms:.4} ms, {:.0} TFLOP/s", tile.kind(grid), flops / ms / 1e9);
            }
        }
    }
}

fn linear_graph(tokens: usize, k: usize, n: usize, gelu: bool, residual: bool) -> Graph {
    use kiln::nn::{Linear, LinearConfig};
    use kiln::{Forward, Module, VarBuilder};
    let t = Tracer::new();
    let x = t.input("x", &[1, tokens, k]);
    let vb = VarBuilder::seeded();
    let mut y: Tensor = Linear::load(vb.pp("fc"), &LinearConfig::new(k, n)).and_then(|fc| fc.forward(&x)).expect("fc");
    if gelu {
        y = y.gelu(false).expect("gelu");
    }
    if residual {
        let proj = Linear::load(vb.pp("proj"), &LinearConfig::new(n, n)).expect("load");
        y = (&proj.forward(&y).expect("proj") + &y).expect("add");
    }
    t.output("y", &y);
    t.graph()
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn linear_engines_on_the_wgmma_gemm_match_the_cpu() {
    let Some(gpu) = hopper_gpu() else { return };
    for (tokens, k, n, gelu, residual) in [(197, 768, 3072, true, false), (50, 136, 200, false, true), (7, 64, 24, true, true)] {
        let g = linear_graph(tokens, k, n, gelu, residual);
        // The wgmma GEMM, then cuBLASLt (with the fused GELU as an in-place kernel after it).
        for source in ["wgmma-gemm", "cublaslt"] {
            let config = BuildConfig::default().precision(Precision::Fp16).batch(1, 3, 3).cuda_graphs(false).tactic_sources(&[source]);
            let engine = Arc::new(EngineBuilder::new(config).with_gpu(gpu.clone()).build(&g).unwrap_or_else(|e| panic!("build: {e}")));
            let kinds: Vec<String> = engine.layers().map(|l| l.kind()).filter(|k| k.contains("gemm")).collect();
            println!("linear {tokens}x{k}->{n} gelu {gelu} residual {residual} on {source}: {kinds:?}");
            assert!(!kinds.is_empty() && kinds.iter().all(|l| l.starts_with(source)), "every GEMM on {source}: {kinds:?}");
            let mut ctx = engine.context().expect("context");
            for batch in [1, 3] {
                let x = random(&[batch, tokens, k], batch as u64, 1.0);
                let want = kiln::run_cpu(&g, &[("x", &x)]).expect("cpu");
                let got = ctx.run(&[("x", &x)]).expect("run");
                let c = kiln::compare("y", &got["y"], &want["y"]);
                println!("  batch {batch}: rel L2 {:.2e}, max-abs {:.2e}", c.rel_l2, c.max_abs);
                assert!(c.rel_l2 < REL_L2_BOUND, "{source} batch {batch}: rel L2 {}", c.rel_l2);
            }
        }
    }
}
