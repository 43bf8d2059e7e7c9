//! Criterion benches of the bundled models' engines: ResNet-18 and ResNet-50 at batch 1, 8, 64 and
//! 256, CenterNet-R50 (512×512) at batch 1, 8 and 32, in FP32 and FP16, with throughput in
//! images/s (`Throughput::Elements(batch)`). One engine per (model, precision, batch), built on
//! first use with a shared timing cache; each iteration is one synchronous run with CUDA graphs.
//!
//! Without a GPU they print `skipping GPU benches: <reason>` and time only the CPU executor on
//! ResNet-18 at batch 1.
//!
//! Here: `cargo bench --bench models` (or `cargo bench --no-run` to only build). On the device,
//! which has no cargo: build here, carry the binary, run it there with `--bench`:
//! ```sh
//! cargo bench --bench models --no-run 2>&1 | grep -o 'target/release/deps/models-[0-9a-f]*' | head -1 \
//!   | xargs -I{} cp {} .carry/bench-models
//! # device: LD_LIBRARY_PATH=... .carry/bench-models --bench [filter, e.g. resnet50/fp16]
//! ```

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kiln::engine::{gpu_available, BuildConfig, EngineBuilder, ExecutionContext, Gpu, Precision};
use kiln::{HostTensor, VarBuilder};
use std::sync::Arc;
use std::time::Duration;

const PLANS: &[(&str, usize, &[usize])] =
    &[("resnet18", 224, &[1, 8, 64, 256]), ("resnet50", 224, &[1, 8, 64, 256]), ("centernet", 512, &[1, 8, 32])];

fn input(batch: usize, size: usize) -> HostTensor {
    kiln::dev::weight("input.0", &[batch, 3, size, size])
}

/// An execution context of an engine for exactly `batch`, inputs bound, its CUDA graph captured.
fn context(gpu: &Arc<Gpu>, model: &str, size: usize, batch: usize, precision: Precision) -> ExecutionContext {
    let graph = kiln_models::trace(model, VarBuilder::seeded(), batch, size).expect("trace");
    let cache = std::env::temp_dir().join("kiln-bench-models.timing.json");
    let config = BuildConfig::default().precision(precision).batch(batch, batch, batch).timing_cache(cache);
    let engine = EngineBuilder::new(config).with_gpu(gpu.clone()).build(&graph).unwrap_or_else(|e| panic!("building {model}: {e}"));
    let mut ctx = Arc::new(engine).context().expect("context");
    ctx.run(&[("input", &input(batch, size))]).expect("first run");
    ctx
}

fn gpu_benches(c: &mut Criterion, gpu: &Arc<Gpu>) {
    for &(model, size, batches) in PLANS {
        for (precision, name) in [(Precision::Fp32, "fp32"), (Precision::Fp16, "fp16")] {
            let mut group = c.benchmark_group(format!("{model}/{name}"));
            for &batch in batches {
                group.throughput(Throughput::Elements(batch as u64));
                // Built inside the routine, which criterion calls only for benches the filter
                // selects, and kept for the routine's later calls.
                let mut ctx: Option<ExecutionContext> = None;
                group.bench_function(BenchmarkId::from_parameter(batch), |b| {
                    let ctx = ctx.get_or_insert_with(|| context(gpu, model, size, batch, precision));
                    b.iter(|| {
                        ctx.execute(batch).expect("execute");
                        ctx.synchronize().expect("synchronize");
                    })
                });
            }
            group.finish();
        }
    }
}

fn cpu_bench(c: &mut Criterion) {
    let graph = kiln::engine::optimize(&kiln_models::trace("resnet18", VarBuilder::seeded(), 1, 224).expect("trace")).expect("passes");
    let x = input(1, 224);
    let mut group = c.benchmark_group("cpu/resnet18");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10).measurement_time(Duration::from_secs(8));
    group.bench_function(BenchmarkId::from_parameter(1), |b| b.iter(|| kiln::run_cpu(&graph, &[("input", &x)]).expect("cpu run")));
    group.finish();
}

fn models(c: &mut Criterion) {
    match gpu_available().map_err(kiln::Error::NoGpu).and_then(|()| Gpu::new(0)) {
        Ok(gpu) => gpu_benches(c, &gpu),
        Err(e) => {
            println!("skipping GPU benches: {e}");
            cpu_bench(c);
        }
    }
}

criterion_group! {
    name = benches;
    // Shorter than criterion's defaults: 22 engines' worth of benches fit in a few minutes.
    config = Criterion::default().warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(3)).sample_size(20);
    targets = models
}
criterion_main!(benches);
