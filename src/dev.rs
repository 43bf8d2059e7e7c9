//! For tools and test suites built on Kiln (Kiln's own CLI and tests use it too): seeded tensors,
//! the CPU simulation of 8-bit engines, layer-by-layer comparison, DOT and Rust code generation,
//! the graph passes one by one, and the build's planning decisions, exposed so that they can be
//! checked without a GPU.
//!
//! Deploying a model never needs this face: the root, [`nn`](crate::nn), [`engine`](crate::engine),
//! [`files`](crate::files) and [`image`](crate::image) hold everything a model needs from its
//! definition to its engine.
//!
//! - seeded tensors: [`weight`] (the seeded `state_dict` that `tools/seeded.py` reproduces in
//!   PyTorch), [`uniform_tensor`], [`fresh_seed`];
//! - [`quant`]: the CPU simulation of INT8 and FP8 engines, and the graphs the builder quantises;
//! - [`layerwise`]: every intermediate tensor compared against a reference;
//! - [`dot`], [`codegen`]: a graph as text, Graphviz DOT, or the Rust that rebuilds it;
//! - [`passes`]: the optimiser's passes one at a time;
//! - [`plan`]: what the builder decides before it touches a GPU (precisions, 8-bit plan, arena);
//! - [`kernels`]: Kiln's CUDA sources and their entry points, to compile them all without a GPU.

pub use crate::cpu::run_with_progress;
pub use crate::graph::numel;
pub use crate::host::{memory_available, Available};
pub use crate::seeded::{fnv1a64, fresh_seed, mix, run_seed, try_uniform_tensor, uniform, uniform_tensor, weight};

/// The CPU simulation of 8-bit engines: a graph quantised with a calibration cache's scales, run
/// by [`run_cpu`](crate::run_cpu), computes what an INT8 or FP8 engine computes (the same rounding,
/// saturation and per-channel weight grids), so an engine is checked against it and not only
/// against FP32.
pub mod quant {
    pub use crate::calibrate::{
        fold_constant_quant, graph_hash, has_quant_nodes, layer_precision, prepare_for_best, prepare_for_engine, quant_points,
        quantised_layers, quantizable, quantize_graph, simulate, simulate_with_rules, simulation, symmetric_scale, tensor_names,
        weight_scales, Histogram, QuantPoint, TensorRange,
    };
}

/// Layer-by-layer comparison: every intermediate tensor of a graph marked as an output, run, and
/// compared against a reference's tensors under the same module paths.
pub mod layerwise {
    pub use crate::layerwise::{
        fused_keys, intermediate_keys, mark_all, mark_intermediates, run, run_quantised, LayerError, LayerwiseReport,
    };
}

/// A graph as text (one node a line) or Graphviz DOT, as `kiln inspect` prints it.
pub mod dot {
    pub use crate::dot::{describe_op, is_fused, to_dot, to_text};
}

/// The Rust source that rebuilds a graph: flat (one statement a node), or structured (module
/// structs, as a person would write the model).
pub mod codegen {
    pub use crate::codegen::{generate, generate_structured, CodegenOptions};
}

/// The passes [`optimize`](crate::engine::optimize) runs, one at a time.
pub mod passes {
    pub use crate::ops::norm::batch_norm_scale_shift;
    pub use crate::passes::{
        attention_from_matmuls, collapse_view_chains, commute_reshape_permute, fold_batchnorm, fold_conv_affine, fold_linear_scale,
        fold_linear_shift, fuse_conv_activation, fuse_conv_max_pool, fuse_linear_activation, fuse_linear_add, optimize,
        packed_attention_from_views, remove_dead_nodes, split_before_permute, topological_order,
    };
}

/// What the builder decides from the graph and the build config alone, before any GPU work.
pub mod plan {
    use crate::engine::{BuildConfig, Precision};
    use crate::Graph;

    pub use crate::engine::arena::ArenaPlan;
    pub use crate::engine::best::LayerTimes;
    pub use crate::engine::eight_bit::{precision_of_kind, EightBitPlan, FP8_GEMM};
    pub use crate::engine::plan::{estimate_arena, layout_copies};
    pub use crate::engine::precision::glob_match;
    pub use crate::engine::resolve::node_precisions;
    pub use crate::ops::quant::fp8_gemm::{probe as probe_fp8_gemm, problem as fp8_gemm_problem, Fp8ProbeResult, Fp8Problem};

    /// Which values an 8-bit engine for `sm` keeps in 8 bits, and which convs run on the 8-bit
    /// kernels (requantising in their epilogue, folding their input's quantiser).
    pub fn eight_bit_plan(graph: &Graph, config: &BuildConfig, sm: u32) -> EightBitPlan {
        crate::ops::conv::conv8::plan(graph, config, &node_precisions(graph, config), sm)
    }

    /// The layers `Precision::Best` keeps on INT8, given each layer's measured time in 16 bits and
    /// in INT8 (the search the builder runs after timing both).
    pub fn best_int8_layers(
        graph: &Graph,
        config: &BuildConfig,
        sm: u32,
        batch: usize,
        fp16: &LayerTimes,
        int8: &LayerTimes,
    ) -> Vec<String> {
        debug_assert!(matches!(config.precision, Precision::Best));
        crate::engine::best::choose(graph, config, sm, batch, fp16, int8)
    }
}

/// Kiln's CUDA sources and their entry points: what `kernels_nvrtc` compiles for the device's
/// architecture on a machine without a GPU.
pub mod kernels {
    pub use crate::engine::cudnn::PAD_CU;
    pub use crate::engine::kernels::{
        cache_dir, cached_compile, compile_all_for, compile_hopper, hopper_arch, nvrtc_available, nvrtc_version, preload_nvrtc, FAMILIES,
        HOPPER, ON_DEMAND, PRELUDE,
    };
    pub use crate::ops::conv::conv8::hopper::entry_points as conv8_hopper_entry_points;
    pub use crate::ops::conv::conv8::{entry_points as conv8_entry_points, CONV8_CU};
    pub use crate::ops::kernel_entry_points;
}

/// The Hopper-native (sm_90a) wgmma GEMM as an engine-level call: what `tests/gpu_hopper_gemm.rs`
/// runs directly against a CPU reference and times against cuBLASLt.
pub mod hopper {
    pub use crate::engine::hopper_gemm::{supports, HopperAct, HopperGemm, HopperGrid, HopperTile};
}

/// Every built-in op, the PyTorch fixture cases each op family is checked against, each family's
/// `kiln::nn` layers and the ATen ops kiln-torch imports as each op.
pub mod ops {
    pub use crate::ops::conv::conv_transpose2d_cpu;
    pub use crate::ops::{aten_imports, builtin_ops, fixture_twins, nn_layers, AtenImport, Fixture, FixtureTwin, NnLayer};
}
