//! A user's own op, added from outside Kiln (this file is a separate crate, as a user's would be):
//! `soft_gate(x) = max(x, 0) / (1 + exp(-x))` with its shape rule and CPU reference
//! (`CustomOp`), its CUDA kernel, and its GPU converter (`kiln::register_converter!`). Tracing,
//! the CPU executor and the engine all pick it up by name. Without a GPU, the GPU half skips.

use kiln::plugin::{grid_for, launch, KArg, BLOCK};
use kiln::plugin::{Attrs, CustomOp};
use kiln::{
    engine::{gpu_available, BuildConfig, EngineBuilder, Gpu, Precision},
    plugin::{BuildCtx, Layer, RunCtx, ValueId},
};
use kiln::{
    nn::{Conv2d, Conv2dConfig},
    Forward, HostTensor, Module, NodeId, Tracer, VarBuilder,
};
use std::sync::Arc;

// ---- the op: shape rule and CPU reference -------------------------------------------------

fn soft_gate(x: f32) -> f32 {
    x.max(0.0) / (1.0 + (-x).exp())
}

kiln::inventory::submit! {
    CustomOp {
        name: "soft_gate",
        infer_shape: |_: &Attrs, inputs: &[&[usize]]| match inputs {
            [x] => Ok(x.to_vec()),
            _ => Err(format!("soft_gate takes one input, got {}", inputs.len())),
        },
        cpu: |_: &Attrs, inputs: &[&HostTensor]| Ok(HostTensor::new(inputs[0].shape.clone(), inputs[0].data.iter().map(|&v| soft_gate(v)).collect())),
    }
}

// ---- its CUDA kernel and converter -----------------------------------------------------------

/// Compiled by Kiln's NVRTC cache for the device; `f16`, `to_f32`, `from_f32` and `GRID_STRIDE`
/// come from Kiln's kernel prelude.
const SOFT_GATE_CU: &str = r#"
template <typename T> __device__ void soft_gate(const T* x, T* y, i64 n) {
    GRID_STRIDE(i, n) {
        float v = to_f32(x[i]);
        y[i] = from_f32<T>((v > 0.f ? v : 0.f) / (1.f + expf(-v)));
    }
}
extern "C" __global__ void soft_gate_f32(const float* x, float* y, i64 n) { soft_gate(x, y, n); }
extern "C" __global__ void soft_gate_f16(const f16* x, f16* y, i64 n) { soft_gate(x, y, n); }
"#;

struct SoftGateLayer {
    path: String,
    x: ValueId,
    y: ValueId,
    per_image: usize,
    sm_count: u32,
    kernel: cudarc::driver::CudaFunction,
}

impl Layer for SoftGateLayer {
    fn path(&self) -> &str {
        &self.path
    }
    fn kind(&self) -> String {
        "user-kernel:soft_gate".into()
    }
    fn enqueue(&self, rt: &RunCtx, batch: usize) -> kiln::Result<()> {
        // Elementwise, so the NHWC order inside the engine does not matter.
        let n = batch * self.per_image;
        launch(
            rt,
            &self.kernel,
            grid_for(n, self.sm_count),
            (BLOCK, 1, 1),
            0,
            &[KArg::Ptr(rt.ptr(self.x)), KArg::Ptr(rt.ptr(self.y)), KArg::I64(n as i64)],
        )
    }
}

fn convert_soft_gate(ctx: &mut BuildCtx, node: NodeId) -> kiln::Result<Box<dyn Layer>> {
    ctx.kernels.add_source("soft_gate.cu", SOFT_GATE_CU)?;
    let (x, y) = (ctx.input(node, 0)?, ctx.output(node)?);
    let kernel = ctx.kernels.get(&format!("soft_gate_{}", ctx.elem().suffix()))?;
    Ok(Box::new(SoftGateLayer {
        path: ctx.node(node).path.clone(),
        x,
        y,
        per_image: ctx.value(y).per_image_elems(),
        sm_count: ctx.kernels.sm_count(),
        kernel,
    }))
}

kiln::register_converter!("soft_gate", convert_soft_gate);

// ---- the tests --------------------------------------------------------------------------------

fn graph() -> kiln::Graph {
    let tracer = Tracer::new();
    let x = tracer.input("x", &[1, 8, 10, 12]);
    let y =
        Conv2d::load(VarBuilder::seeded().pp("conv"), &Conv2dConfig::new(8, 16, 3).padding(1)).expect("conv").forward(&x).expect("conv");
    let y = y.custom("soft_gate", &[], &[]).expect("the registered op traces");
    tracer.output("y", &y);
    tracer.graph()
}

fn input(batch: usize) -> HostTensor {
    let n = batch * 8 * 10 * 12;
    HostTensor::new(vec![batch, 8, 10, 12], (0..n).map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 2.0).collect())
}

#[test]
fn the_user_op_traces_and_runs_on_the_cpu() {
    let g = graph();
    assert!(g.nodes.iter().any(|n| n.op.name() == "soft_gate" && n.path.ends_with("soft_gate")), "{}", g.to_text());
    let x = input(2);
    let y = &kiln::run_cpu(&g, &[("x", &x)]).expect("cpu")["y"];
    assert_eq!(y.shape, vec![2, 16, 10, 12]);
    assert!(y.data.iter().all(|&v| v >= 0.0), "soft_gate is never negative");
    kiln::plugin::check_converters(&g).expect("the user's converter is registered");
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored on the device (tools/gpu-test.sh)"]
fn the_user_op_runs_in_an_engine_and_matches_its_cpu_reference() {
    if let Err(why) = gpu_available() {
        println!("skipped: no GPU ({why})");
        return;
    }
    let gpu: Arc<Gpu> = Gpu::new(0).expect("gpu");
    let g = graph();
    for (precision, tol) in [(Precision::Fp32, 1e-5), (Precision::Fp16, 1e-2)] {
        let engine = Arc::new(
            EngineBuilder::new(BuildConfig::default().precision(precision).batch(1, 4, 4)).with_gpu(gpu.clone()).build(&g).expect("build"),
        );
        assert!(engine.layers().any(|l| l.kind() == "user-kernel:soft_gate"), "{}", engine.describe());
        let mut ctx = engine.context().expect("context");
        for batch in [1, 4] {
            let x = input(batch);
            let want = kiln::run_cpu(&g, &[("x", &x)]).expect("cpu");
            let got = ctx.run(&[("x", &x)]).expect("engine");
            let c = kiln::compare("soft_gate", &got["y"], &want["y"]);
            println!("user op soft_gate {precision:?} batch {batch}: {c}");
            assert!(c.passes(tol), "{c}");
        }
    }
}
