//! The `kiln` command line: argument definitions (clap derive) and dispatch. Each command lives in
//! its own file; `common` holds what they share (loading a model, making an input, building or
//! loading an engine, summarising outputs).

/// `println!` that returns a failed write as an error instead of panicking, so that
/// `kiln run ... | head -1` ends cleanly when the reader closes the pipe.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::cli::emit(format_args!("{}\n", format_args!($($arg)*)))?
    };
}

/// `print!` counterpart of `say!`.
macro_rules! say_raw {
    ($($arg:tt)*) => {
        $crate::cli::emit(format_args!($($arg)*))?
    };
}

mod bench;
mod calibrate;
mod common;
mod compare;
mod inspect;
mod run;

use clap::{Args, Parser, Subcommand};
use kiln::Error;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// `kiln --help`'s epilogue; its list of models comes from `kiln_models::BUNDLED`.
fn examples() -> String {
    let models: Vec<String> = kiln_models::BUNDLED.iter().map(|m| format!("{} ({}x{})", m.name, m.input_size, m.input_size)).collect();
    format!(
        "\
Examples:
  kiln run resnet50                                  # seeded weights, random input, GPU or CPU
  kiln run resnet18 --weights resnet18.safetensors --input image.safetensors
  kiln build resnet50 --fp16 --min-batch 1 --opt-batch 8 --max-batch 64 -o rn50.kiln
  kiln bench rn50.kiln --batch 8                     # latency and throughput of a saved engine
  kiln bench resnet18 --batch 1,8,64 --json rn18.json
  kiln profile centernet --fp16                      # per-layer times by module path
  kiln compare resnet50 --reference resnet50.reference.safetensors --layerwise
  kiln inspect resnet18 --dot before.dot --dot-optimized after.dot
  kiln codegen resnet18 -o resnet18_gen.rs

Bundled models: {}.
Weights are seeded (deterministic, like tools/export_reference.py --weights seeded) unless
--weights names a PyTorch state_dict saved with safetensors.torch.save_file.",
        models.join(", ")
    )
}

/// The help line of a command's model argument.
fn model_help(engine_file_too: bool) -> String {
    let or_engine = if engine_file_too { ", or an engine file from `kiln build`" } else { "" };
    format!("A bundled model ({}){or_engine}", kiln_models::bundled_names())
}

/// Kiln: compile convolutional networks to CUDA engines, and the tools to check and measure them.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, after_long_help = examples(), propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a model once on a random or given input and print its top classes or detections.
    ///
    /// Uses the GPU engine when a GPU is present, otherwise the CPU reference executor (with a
    /// note saying why). Prints the output summary and the time taken.
    #[command(
        after_long_help = "Examples:\n  kiln run resnet50\n  kiln run centernet --batch 2 --fp32\n  kiln run resnet18 --cpu --input x.safetensors"
    )]
    Run(RunArgs),
    /// Build an engine file from a bundled model (needs a GPU).
    ///
    /// Traces the model, runs the graph passes (BatchNorm folding, conv+bias+add+ReLU fusion),
    /// times the candidate algorithms of each layer on the device, and writes the engine. Prints
    /// what was fused and the engine's device memory.
    #[command(
        after_long_help = "Examples:\n  kiln build resnet50 -o rn50.kiln\n  kiln build centernet --fp16 --max-batch 32 --opt-batch 8 --timing-cache tc.bin -o cn.kiln"
    )]
    Build(BuildArgs),
    /// Measure latency (median, p90, p99) and throughput, with and without CUDA graphs (needs a GPU,
    /// or --cpu).
    ///
    /// Like trtexec: warm up for --warmup ms, then run at least --iterations times and at least
    /// --duration seconds; each timed run is synchronous (enqueue + wait), so latency is what a
    /// caller sees.
    #[command(
        after_long_help = "Examples:\n  kiln bench resnet50 --batch 1,64 --fp16\n  kiln bench rn50.kiln --batch 8 --json out.json\n  kiln bench resnet18 --cpu --iterations 3 --duration 0"
    )]
    Bench(BenchArgs),
    /// Per-layer device time, named by module path, sorted, with each layer's share (needs a GPU).
    #[command(after_long_help = "Examples:\n  kiln profile resnet50 --batch 8\n  kiln profile cn.kiln --top 20")]
    Profile(ProfileArgs),
    /// Compare outputs with a PyTorch reference from tools/export_reference.py.
    ///
    /// Prints per-output relative L2 and max-abs errors and pass/fail against --rtol. With
    /// --layerwise, every intermediate the reference holds (export it with `--intermediates all`)
    /// is marked as an output and compared, and the first layer whose error jumps is named.
    #[command(
        after_long_help = "Examples:\n  python tools/export_reference.py --model resnet50 --intermediates all --save-weights\n  kiln compare resnet50 --reference resnet50.reference.safetensors --weights resnet50.weights.safetensors\n  kiln compare resnet50 --reference resnet50.reference.safetensors --cpu --layerwise"
    )]
    Compare(CompareArgs),
    /// Print the traced graph and the optimised graph (and the engine's layers when a GPU is
    /// present); write Graphviz DOT before and after fusion.
    #[command(
        after_long_help = "Examples:\n  kiln inspect resnet18\n  kiln inspect resnet50 --dot before.dot --dot-optimized after.dot && dot -Tsvg after.dot -o after.svg"
    )]
    Inspect(InspectArgs),
    /// Emit Rust source that rebuilds the traced network with Kiln's tracing API, weights by name.
    #[command(
        after_long_help = "Examples:\n  kiln codegen resnet18 -o resnet18_gen.rs\n  kiln codegen centernet --fn-name centernet_graph --max-width 140"
    )]
    Codegen(CodegenArgs),
    /// Record activation ranges over a calibration set (CPU) and write an INT8/FP8 calibration cache.
    ///
    /// Methods are TensorRT's: entropy (KL divergence, the default), percentile (99.99) and
    /// min-max. The cache is readable JSON; `--int8`/`--fp8` builds read it with
    /// --calibration-cache and need no data.
    #[command(
        after_long_help = "Examples:\n  kiln calibrate digits_resnet --weights models/weights/digits_resnet.safetensors --data calib.safetensors --images 100\n  kiln build resnet50 --int8 --calibration-cache resnet50.calib.json -o rn50.int8.kiln"
    )]
    Calibrate(calibrate::CalibrateArgs),
}

/// Which model, with which weights, on which input.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    #[arg(help = model_help(false))]
    pub model: String,
    /// A safetensors state_dict (PyTorch names, f32/f16/bf16) instead of the seeded weights.
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Fail when the weight file holds keys the model never uses.
    #[arg(long)]
    pub strict: bool,
    /// Input height and width (default: the model's, listed in `kiln --help`).
    #[arg(long, value_name = "PIXELS")]
    pub size: Option<usize>,
}

/// Engine build settings shared by every command that builds one.
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// FP16 storage and tensor cores, f32 accumulation (the default).
    #[arg(long, group = "precision")]
    pub fp16: bool,
    /// Strict FP32: no TF32 rounding anywhere.
    #[arg(long, group = "precision")]
    pub fp32: bool,
    /// FP32 storage, TF32 tensor-core math.
    #[arg(long, group = "precision")]
    pub tf32: bool,
    /// INT8 convolutions and Linear layers (scales from --calibration-cache or the graph's Q/DQ
    /// nodes), FP16 elsewhere.
    #[arg(long, group = "precision")]
    pub int8: bool,
    /// FP8 (e4m3) convolutions and Linear layers, FP16 elsewhere (sm_89 or newer).
    #[arg(long, group = "precision")]
    pub fp8: bool,
    /// Per layer, the fastest of FP16, INT8 and FP8 (TensorRT's --best).
    #[arg(long, group = "precision")]
    pub best: bool,
    /// The calibration cache (`kiln calibrate`) of --int8/--fp8/--best builds.
    #[arg(long, value_name = "FILE")]
    pub calibration_cache: Option<PathBuf>,
    /// Scratch memory limit per layer, in MiB. A limit, not an allocation: the engine allocates the
    /// largest workspace its chosen layers need. Too low a limit rules out fast algorithms (FP32
    /// CenterNet at batch 32: 853 ms with 256 MiB, 76 ms with 4096 MiB on an H200).
    #[arg(long, value_name = "MiB", default_value_t = 4096)]
    pub workspace: usize,
    /// Timing cache file: read before timing algorithms, written after, so rebuilds are fast.
    #[arg(long, value_name = "FILE")]
    pub timing_cache: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Images in the batch (default 1; with --input, whose shape decides, it must agree).
    #[arg(long)]
    pub batch: Option<usize>,
    /// A safetensors file holding the input as `input` (or as its only tensor), NCHW f32.
    #[arg(long, value_name = "FILE")]
    pub input: Option<PathBuf>,
    /// Seed of the random input (default: from the clock, printed so a run can be repeated).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Use the CPU reference executor even when a GPU is present.
    #[arg(long)]
    pub cpu: bool,
    /// How many top classes / detections to print per image.
    #[arg(long, default_value_t = 5)]
    pub top: usize,
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Where to write the engine.
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
    /// Smallest batch the engine accepts.
    #[arg(long, default_value_t = 1)]
    pub min_batch: usize,
    /// The batch algorithms are timed at (default: --max-batch).
    #[arg(long)]
    pub opt_batch: Option<usize>,
    /// Largest batch the engine accepts (activation memory is planned for it).
    #[arg(long, default_value_t = 1)]
    pub max_batch: usize,
    /// Print every timed candidate of every layer.
    #[arg(long, short)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[arg(help = model_help(true))]
    pub model: String,
    /// Weights for a bundled model (default: seeded).
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Input height and width for a bundled model (default: the model's).
    #[arg(long, value_name = "PIXELS")]
    pub size: Option<usize>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Batch sizes, comma-separated; a bundled model gets one engine per batch.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<usize>,
    /// Warm-up time before timing, in milliseconds (trtexec: 200).
    #[arg(long, value_name = "MS", default_value_t = 200)]
    pub warmup: u64,
    /// Minimum number of timed runs (trtexec: 10).
    #[arg(long, default_value_t = 10)]
    pub iterations: usize,
    /// Minimum total timed duration, in seconds (trtexec: 3).
    #[arg(long, value_name = "S", default_value_t = 3.0)]
    pub duration: f64,
    /// Time only with CUDA graphs (default: both with and without).
    #[arg(long, conflicts_with = "no_cuda_graphs")]
    pub cuda_graphs_only: bool,
    /// Time only without CUDA graphs.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Benchmark the CPU reference executor instead of an engine.
    #[arg(long)]
    pub cpu: bool,
    /// Also write the results as JSON (an array of records) to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[arg(help = model_help(true))]
    pub model: String,
    /// Weights for a bundled model (default: seeded).
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Input height and width for a bundled model.
    #[arg(long, value_name = "PIXELS")]
    pub size: Option<usize>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Back-to-back replays of each layer (captured alone in a CUDA graph); its time is their mean.
    #[arg(long, default_value_t = 50)]
    pub iterations: usize,
    /// Show only the N slowest layers (0: all).
    #[arg(long, default_value_t = 0)]
    pub top: usize,
}

#[derive(Args, Debug)]
pub struct CompareArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Reference safetensors from tools/export_reference.py: `input`, `output.<name>`, and
    /// `intermediate.<module path>` for --layerwise.
    #[arg(long, value_name = "FILE")]
    pub reference: PathBuf,
    /// Relative L2 tolerance (default: 1e-5 on the CPU, 1e-4 FP32, 2e-3 TF32, 1e-2 FP16).
    #[arg(long)]
    pub rtol: Option<f64>,
    /// Compare on the CPU reference executor instead of an engine.
    #[arg(long)]
    pub cpu: bool,
    /// Compare every intermediate in the reference and name the first layer whose error jumps.
    #[arg(long)]
    pub layerwise: bool,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Write the traced graph as Graphviz DOT to FILE.
    #[arg(long, value_name = "FILE")]
    pub dot: Option<PathBuf>,
    /// Write the optimised graph (folded, fused) as Graphviz DOT to FILE.
    #[arg(long, value_name = "FILE")]
    pub dot_optimized: Option<PathBuf>,
    /// Skip building an engine even when a GPU is present.
    #[arg(long)]
    pub no_engine: bool,
}

#[derive(Args, Debug)]
pub struct CodegenArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Where to write the Rust source (default: standard output).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Name of the generated function `fn(vb: &VarBuilder, batch: usize) -> Result<Graph>`.
    #[arg(long, default_value = "build")]
    pub fn_name: String,
    /// Line width to lay the code out for (rustfmt's max_width).
    #[arg(long, default_value_t = 100)]
    pub max_width: usize,
    /// Lay out for rustfmt's `use_small_heuristics = "Max"` (Kiln's own style) instead of the default.
    #[arg(long)]
    pub small_heuristics_max: bool,
}

/// Parses the command line, runs the command, prints `error: ...` and exits non-zero on failure.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Build(a) => run::build(a),
        Command::Bench(a) => bench::bench(a),
        Command::Profile(a) => bench::profile(a),
        Command::Compare(a) => compare::compare(a),
        Command::Inspect(a) => inspect::inspect(a),
        Command::Codegen(a) => inspect::codegen(a),
        Command::Calibrate(a) => calibrate::calibrate(a),
    };
    match result {
        Ok(code) => code,
        // The reader of our output went away (`| head -1`): what it wanted, it got.
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes to standard output; a failed write (a closed pipe) is returned, not a panic.
pub(crate) fn emit(args: std::fmt::Arguments) -> kiln::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args).and_then(|()| out.flush()).map_err(|source| Error::Io { path: "standard output".into(), source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
