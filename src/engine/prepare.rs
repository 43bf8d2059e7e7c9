//! Preparation: everything a build does to a graph before it touches the GPU, in one call. The
//! config and every op's converter are checked, the passes run, and the graph gets its precision's
//! quantisers (`calibrate`): an 8-bit engine's from the calibration cache or the graph's own Q/DQ
//! nodes, `Best`'s INT8 ranges with the weights unfolded (its search picks the INT8 convs while
//! lowering, `engine::best`).

use super::config::BuildConfig;
use super::precision::Precision;
use crate::calibrate;
use crate::graph::Graph;
use crate::Result;

/// The graph an engine of `config` lowers, from the traced `graph`. Errors name the flag, the
/// op and module path, or the calibration cache.
pub(crate) fn prepare(graph: &Graph, config: &BuildConfig) -> Result<Graph> {
    config.validate()?;
    config.validate_profiles(graph)?;
    crate::ops::check_converters(graph)?;
    let optimized = crate::passes::optimize(graph)?;
    crate::ops::check_converters(&optimized)?;
    with_precision(optimized, config)
}

/// `optimized` with what its precision needs of calibration.
fn with_precision(optimized: Graph, config: &BuildConfig) -> Result<Graph> {
    let cache = config.calibration_cache.as_deref();
    match config.precision {
        Precision::Best => calibrate::prepare_for_best(optimized, cache, &config.layer_precisions),
        p => match p.quant_format() {
            Some(format) => calibrate::prepare_for_engine(optimized, format, cache, &config.layer_precisions),
            // A Q/DQ graph in FP16/FP32 runs its quantisers as they are; weights' are folded.
            None if calibrate::has_quant_nodes(&optimized) => calibrate::fold_constant_quant(&optimized),
            // `passes::fuse_linear_activation` (a Linear's activation in its GEMM's epilogue) is
            // not applied yet: its only gain is the wgmma GEMM's, which loses to cuBLASLt on every
            // ViT-B/16 shape (docs/PERFORMANCE.md, step 11), and the fused graph has not been
            // measured on the bundled transformers' engines. Both layer forms of the fused node
            // ran on an H200 (`tests/gpu_hopper_gemm.rs`).
            None => Ok(optimized),
        },
    }
}
