//! The `kiln` command line: argument definitions (clap derive) and dispatch. Each command lives in
//! its own file; `common` holds what they share (loading a model, making an input, building or
//! loading an engine, summarising outputs).

/// `println!` that returns a failed write as an error instead of panicking, so that
/// `kiln run ... | head -1` ends cleanly when the reader closes the pipe.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::emit(format_args!("{}\n", format_args!($($arg)*)))?
    };
}

/// `print!` counterpart of `say!`.
macro_rules! say_raw {
    ($($arg:tt)*) => {
        $crate::emit(format_args!($($arg)*))?
    };
}

mod bench;
mod calibrate;
mod common;
mod compare;
mod images;
mod inspect;
mod models;
mod run;
pub mod shapes;
mod triton;

use clap::{ArgAction, Args, Parser, Subcommand};
use kiln::{Error, Graph, VarBuilder};
use shapes::{parse_shapes, ShapeSpec};
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// How a program's own model is traced: with its weights, at a batch, and at an input height and
/// width (`None`: the model's own size). The graph's first input is named `input`.
pub type TraceFn = fn(vb: VarBuilder, batch: usize, hw: Option<[usize; 2]>) -> kiln::Result<Graph>;

/// Every example line of `kiln --help`; each must parse (tested), and none is wrapped (the help is
/// laid out with `term_width(0)`, so a terminal's soft wrap is the only wrap and copy-paste works).
pub const EXAMPLES: &[&str] = &[
    "kiln run resnet50",
    "kiln run resnet18 --weights resnet18.safetensors --input image.safetensors",
    "kiln trace resnet18 -o resnet18.kiln.safetensors",
    "kiln run resnet18.kiln.safetensors --cpu",
    "kiln build resnet50 --fp16 --min-batch 1 --opt-batch 8 --max-batch 64 -o rn50.kiln",
    "kiln build resnet50 --minShapes input:1x3x224x224 --optShapes input:8x3x224x224 --maxShapes input:64x3x224x224 --saveEngine rn50.kiln",
    "kiln bench --loadEngine rn50.kiln --shapes input:8x3x224x224 --warmUp 500 --duration 10 --percentile 99.9 --export-times times.json",
    "kiln bench resnet18 --batch 1,8,64 --json rn18.json",
    "kiln profile centernet --fp16 --csv layers.csv",
    "kiln compare resnet50 --reference resnet50.reference.safetensors --layerwise",
    "kiln compare resnet50 --fp32 --save-outputs fp32.safetensors",
    "kiln compare resnet50 --fp16 --load-outputs fp32.safetensors --atol 1e-2 --rtol 1e-2 --report fp16.json",
    "kiln inspect resnet18 --dot before.dot --dot-optimized after.dot",
    "kiln codegen resnet18 -o resnet18_gen.rs",
    "kiln run mobilenet_v2 --weights mobilenet_v2-b0353104.pth --image cat.jpg",
    "kiln run yolov8n --weights yolov8n.safetensors --image street.jpg --save boxes.png",
    "kiln triton-repo resnet18 -o repo --cpu",
    "kiln models --json",
];

/// `kiln --help`'s epilogue; its list of models comes from `kiln_models::BUNDLED` and the
/// program's own models.
fn examples() -> String {
    let models: Vec<String> = kiln_models::BUNDLED.iter().map(|m| format!("{} ({}x{})", m.name, m.input_size, m.input_size)).collect();
    let lines: Vec<String> = EXAMPLES.iter().map(|e| format!("  {e}")).collect();
    format!(
        "\
Examples:
{}

Bundled models: {}.
A model argument is a bundled name, a graph file (.kiln.safetensors, from `kiln trace` or Graph::save) or an engine file (.kiln, from `kiln build`).
Weights are seeded (random but deterministic, like tools/export_reference.py --weights seeded; `kiln run` says its answers are then meaningless) unless --weights names a state_dict: a safetensors file or a PyTorch checkpoint (.pth/.pt). digits_resnet loads its trained weights (built in) by default.
Logging: diagnostics go to standard error (RUST_LOG=kiln=debug, -v, -q), results to standard output.",
        lines.join("\n"),
        models.join(", ")
    )
}

/// The help line of a command's model argument.
fn model_help() -> String {
    format!(
        "A bundled model ({}), a graph file (.kiln.safetensors, from `kiln trace`), or an engine file (.kiln, from `kiln build`)",
        kiln_models::bundled_names()
    )
}

/// Kiln: compile convolutional networks to CUDA engines, and the tools to check and measure them.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, after_long_help = examples(), propagate_version = true, term_width = 0)]
pub struct Cli {
    /// More diagnostics on standard error (-v: debug, -vv: trace); RUST_LOG overrides.
    #[arg(short, long, action = ArgAction::Count, global = true, display_order = 1000)]
    pub verbose: u8,
    /// Only errors on standard error.
    #[arg(short, long, global = true, conflicts_with = "verbose", display_order = 1001)]
    pub quiet: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run a model once on a random input, a given tensor or image files, and print its top classes or detections.
    ///
    /// Uses the GPU engine when a GPU is present, otherwise the CPU reference executor (with a
    /// note on standard error saying why). Prints the output summary and the time taken.
    #[command(
        after_long_help = "Examples:\n  kiln run resnet50\n  kiln run mobilenet_v2 --weights mobilenet_v2-b0353104.pth --image cat.jpg --image cup.png --cpu\n  kiln run yolov8n --weights yolov8n.safetensors --image street.jpg --save boxes.png\n  kiln run centernet --batch 2 --fp32\n  kiln run resnet18 --cpu --input x.safetensors\n  kiln run mynet.kiln.safetensors --cpu --shapes input:2x3x32x32"
    )]
    Run(RunArgs),
    /// Trace a model and write it with its weights as a graph file (one safetensors file whose
    /// metadata holds the graph); every command takes the file in place of the model's name.
    #[command(
        after_long_help = "Examples:\n  kiln trace resnet18 -o resnet18.kiln.safetensors\n  kiln trace centernet --weights centernet.safetensors --shapes input:1x3x384x512 -o cn.kiln.safetensors"
    )]
    Trace(TraceArgs),
    /// Build an engine file from a model or graph file (needs a GPU).
    ///
    /// Traces the model, runs the graph passes (BatchNorm folding, conv+bias+add+ReLU fusion),
    /// times the candidate algorithms of each layer on the device, and writes the engine. Prints
    /// what was fused and the engine's device memory; -v lists every timed candidate.
    #[command(
        after_long_help = "Examples:\n  kiln build resnet50 -o rn50.kiln\n  kiln build centernet --fp16 --max-batch 32 --opt-batch 8 --timing-cache tc.bin -o cn.kiln\n  kiln build resnet50 --minShapes input:1x3x224x224 --optShapes input:8x3x224x224 --maxShapes input:32x3x224x224 --saveEngine rn50.kiln\n  kiln build resnet50 --int8 --calibration-cache c.json --tactic-sources kernel:conv8 -o rn50-int8.kiln"
    )]
    Build(BuildArgs),
    /// Measure latency (median, p90, p99, max, standard deviation) and throughput, with and without
    /// CUDA graphs (needs a GPU, or --cpu).
    ///
    /// Like trtexec: warm up for --warmUp ms, then run at least --iterations times and at least
    /// --duration seconds; each timed run is synchronous (enqueue + wait), so latency is what a
    /// caller sees.
    #[command(
        after_long_help = "Examples:\n  kiln bench resnet50 --batch 1,64 --fp16\n  kiln bench rn50.kiln --batch 8 --json out.json\n  kiln bench --loadEngine rn50.kiln --shapes input:8x3x224x224 --percentile 99.9 --export-times times.json\n  kiln bench resnet18 --cpu --iterations 3 --duration 0"
    )]
    Bench(BenchArgs),
    /// Per-layer device time, named by module path, sorted, with each layer's share (needs a GPU).
    #[command(
        after_long_help = "Examples:\n  kiln profile resnet50 --batch 8\n  kiln profile cn.kiln --top 20\n  kiln profile --loadEngine rn50.kiln --batch 8 --export-profile layers.json --csv layers.csv"
    )]
    Profile(ProfileArgs),
    /// Compare outputs with a PyTorch reference (tools/export_reference.py) or with saved outputs.
    ///
    /// Prints per-output relative L2 and max-abs errors; an output passes when its relative L2 is
    /// within --l2-tol and, with --atol/--rtol, every element satisfies Polygraphy's rule
    /// |out - ref| <= atol + rtol * |ref|. With --layerwise, every intermediate the reference holds
    /// (export it with `--intermediates all`) is marked as an output and compared, and the first
    /// layer whose error jumps is named. Without a reference, a random input (--seed) is run and
    /// --save-outputs writes it with the outputs, to --load-outputs in a later run.
    #[command(
        after_long_help = "Examples:\n  python tools/export_reference.py --model resnet50 --intermediates all --save-weights\n  kiln compare resnet50 --reference resnet50.reference.safetensors --weights resnet50.weights.safetensors\n  kiln compare resnet50 --reference resnet50.reference.safetensors --cpu --layerwise\n  kiln compare resnet50 --fp32 --save-outputs fp32.safetensors\n  kiln compare resnet50 --fp16 --load-outputs fp32.safetensors --atol 1e-2 --rtol 1e-2 --report fp16.json"
    )]
    Compare(CompareArgs),
    /// Print the traced graph, the optimised graph and the layout copies the builder will plan
    /// (each value read in another layout than it is stored in), and the engine's layers when a
    /// GPU is present; write Graphviz DOT before and after fusion.
    #[command(
        after_long_help = "Examples:\n  kiln inspect resnet18\n  kiln inspect resnet50 --dot before.dot --dot-optimized after.dot\n  kiln inspect rn50.kiln"
    )]
    Inspect(InspectArgs),
    /// Emit Rust source that rebuilds the network: Kiln modules, one `#[derive(Module)]` struct per
    /// PyTorch class with fields named as the state_dict (a kiln-torch graph file), or with
    /// --flat (and for graphs without module classes, such as the bundled models) the op list
    /// on Kiln's tracing API, weights by name.
    #[command(
        after_long_help = "Examples:\n  kiln codegen rn50.kiln.safetensors -o rn50.rs\n  kiln codegen rn50.kiln.safetensors --flat -o rn50_ops.rs\n  kiln codegen resnet18 -o resnet18_gen.rs\n  kiln codegen centernet --fn-name centernet_graph --max-width 140"
    )]
    Codegen(CodegenArgs),
    /// Record activation ranges over a calibration set (CPU) and write an INT8/FP8 calibration cache.
    ///
    /// Methods: mse (the default: Model Optimizer's least squared error, a threshold per format),
    /// percentile (99.99), TensorRT's entropy (KL divergence) and min-max. The cache is
    /// readable JSON; `--int8`/`--fp8` builds (and `--cpu` runs, which simulate them) read it with
    /// --calibration-cache and need no data.
    #[command(
        after_long_help = "Examples:\n  kiln calibrate digits_resnet --data calib.safetensors --images 100\n  kiln calibrate resnet50 --weights resnet50.pth --data photos/ --images 100\n  kiln build resnet50 --int8 --calibration-cache resnet50.calib.json -o rn50.int8.kiln"
    )]
    Calibrate(calibrate::CalibrateArgs),
    /// Write a ready Triton Inference Server model repository: the model file, a config.pbtxt
    /// (inputs, outputs, dims, max batch, dynamic batching, instance group) and a README with the
    /// server's command; served by Kiln's backend, libtriton_kiln.so (docs/SERVING.md).
    #[command(
        name = "triton-repo",
        after_long_help = "Examples:\n  kiln triton-repo resnet18 -o repo --cpu\n  kiln triton-repo rn50.kiln -o repo --name resnet50 --gpus 0,1\n  kiln triton-repo yolov8n --letterbox 720x1280 -o repo --precision fp16 --max-batch-size 16"
    )]
    TritonRepo(triton::TritonRepoArgs),
    /// List the bundled models (name, default input, outputs, what it is) and the program's own.
    ///
    /// `--json` writes them for scripts: the Python tools (tools/export_reference.py,
    /// tools/bench_zoo.py) read the list from here, so `kiln_models::BUNDLED` is its one home.
    #[command(after_long_help = "Examples:\n  kiln models\n  kiln models --json")]
    Models(ModelsArgs),
}

#[derive(Args, Debug)]
pub struct ModelsArgs {
    /// Write the list as JSON: name, input_size, outputs, family, torchvision, description.
    #[arg(long)]
    pub json: bool,
}

/// A `--shapes`-style flag value: one or more `name:d0xd1x...`, comma-separated.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Shapes(pub Vec<ShapeSpec>);

fn shapes_parser(value: &str) -> Result<Shapes, String> {
    parse_shapes(value).map(Shapes)
}

/// Which model, with which weights, on which input.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    #[arg(help = model_help())]
    pub model: String,
    /// A state_dict (PyTorch names, f32/f16/bf16) as safetensors or a PyTorch checkpoint (.pth/.pt), instead of the model's default weights: seeded random ones, or digits_resnet's trained ones (for a graph file: replaces its weights by name).
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Fail when the weight file holds keys the model never uses.
    #[arg(long)]
    pub strict: bool,
    /// Input height and width (default: the model's, listed in `kiln --help`).
    #[arg(long, value_name = "PIXELS")]
    pub size: Option<usize>,
    /// The input's shape, trtexec-style: `input:NxCxHxW` (batch and H x W; a graph file re-infers its shapes at another H x W, an engine file runs any H x W inside its profiles).
    #[arg(long, value_name = "NAME:DIMS", value_parser = shapes_parser)]
    pub shapes: Option<Shapes>,
    /// A bundled classifier or YOLO behind its GPU entry stage: its input `frame` is decoded u8 frames of this size, `HxW` (RGB) or `HxW:bgr` (e.g. 480x640), resized, cropped and normalised (classifiers: torchvision's preset) or letterboxed (YOLO) inside the model.
    #[arg(long, value_name = "HxW[:bgr]", conflicts_with_all = ["size", "shapes"])]
    pub frames: Option<String>,
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
    /// Per layer, the fastest of FP16, FP8 GEMMs and INT8 convs by timing (TensorRT's --best):
    /// the build profiles an all-16-bit and an all-INT8 plan and keeps the fastest mix (about
    /// three builds' time). Needs --calibration-cache; layers that keep 16 bits run on
    /// unquantised values with no quantiser.
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
    /// Give each layer its fastest algorithm within --workspace, as TensorRT does, even where its
    /// workspace grows the arena. Without it a layer takes the fastest algorithm that fits the
    /// room the activations leave (ResNet-18 at batch 256: 0.5 ms slower, 490 MiB smaller).
    #[arg(long)]
    pub fastest: bool,
    /// Timing cache file: read before timing algorithms, written after, so rebuilds are fast.
    #[arg(long, value_name = "FILE")]
    pub timing_cache: Option<PathBuf>,
    /// Per-layer precisions, trtexec's --layerPrecisions (obeyed): `pattern:fp32|tf32|fp16,...`;
    /// a pattern is a module path or glob (`*`, `?`) and covers what is under it; the last match wins.
    /// In an --int8/--fp8/--best engine the layers it covers are not quantised (e.g. `conv1:fp16`
    /// keeps the first conv in 16 bits, as `kiln run --cpu` then simulates).
    #[arg(long, value_name = "PATTERN:PREC,...", value_parser = layer_precisions_parser)]
    pub layer_precisions: Option<LayerPrecisions>,
    /// Restrict each layer's algorithms to those whose kind starts with one of these prefixes
    /// (trtexec's --tacticSources, by kind): e.g. `cudnn` or `kernel:conv8_i8_wgmma`. The kinds
    /// are the ones `kiln profile` and `kiln inspect` print; a layer with none of them keeps all of
    /// its own, and a forced one that cannot run here is a build error naming it.
    #[arg(long, value_name = "PREFIX,...", value_delimiter = ',')]
    pub tactic_sources: Vec<String>,
}

/// A `--layer-precisions` value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerPrecisions(pub Vec<kiln::engine::LayerPrecision>);

fn layer_precisions_parser(value: &str) -> Result<LayerPrecisions, String> {
    kiln::engine::LayerPrecision::parse_list(value).map(LayerPrecisions).map_err(|e| e.to_string())
}

#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Images in the batch (default 1; with --input, whose shape decides, it must agree; --shapes gives it too).
    #[arg(long)]
    pub batch: Option<usize>,
    /// A safetensors file holding the input as `input` (or as its only tensor), NCHW f32.
    #[arg(long, value_name = "FILE", conflicts_with = "image")]
    pub input: Option<PathBuf>,
    /// An image file (JPEG, PNG, BMP, GIF, WebP, PNM, TIFF), once per image of the batch, made into
    /// the input by the model's preprocessing (a classifier: torchvision's Resize, CenterCrop and
    /// ImageNet normalisation; YOLO and CenterNet: a letterbox). Prints class names or labelled boxes.
    #[arg(long, value_name = "FILE")]
    pub image: Vec<PathBuf>,
    /// Draw a detector's boxes (YOLO, CenterNet) on the --image and write it as PNG to FILE
    /// (several images: FILE with _0, _1, ... before its extension).
    #[arg(long, value_name = "FILE", requires = "image")]
    pub save: Option<PathBuf>,
    /// Decode a truncated JPEG as it is, with a warning (its missing rows come out grey and
    /// change the answer), instead of refusing it.
    #[arg(long, requires = "image")]
    pub accept_truncated_images: bool,
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
pub struct TraceArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The batch to trace at (default 1, or --shapes's N; the CPU executor runs a graph file at any batch; engines take --min-batch/--max-batch).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Where to write the graph file (`.kiln.safetensors` by convention).
    #[arg(short, long, value_name = "FILE")]
    pub output: PathBuf,
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Where to write the engine (trtexec: --saveEngine).
    #[arg(short, long, value_name = "FILE", visible_alias = "saveEngine")]
    pub output: PathBuf,
    /// Smallest batch the engine accepts (default 1).
    #[arg(long)]
    pub min_batch: Option<usize>,
    /// The batch algorithms are timed at (default: --max-batch).
    #[arg(long)]
    pub opt_batch: Option<usize>,
    /// Largest batch the engine accepts (default 1; activation memory is planned for it).
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// trtexec's name for the smallest shape, `input:NxCxHxW`: its N sets --min-batch; H and W may range up to --maxShapes (an optimization profile; C stays the model's).
    #[arg(long = "minShapes", value_name = "NAME:DIMS", value_parser = shapes_parser, requires_all = ["opt_shapes", "max_shapes"])]
    pub min_shapes: Option<Shapes>,
    /// trtexec's name for the shape algorithms are timed at (and the model is traced at): its N sets --opt-batch.
    #[arg(long = "optShapes", value_name = "NAME:DIMS", value_parser = shapes_parser, requires_all = ["min_shapes", "max_shapes"])]
    pub opt_shapes: Option<Shapes>,
    /// trtexec's name for the largest shape: its N sets --max-batch (activation memory is planned for it).
    #[arg(long = "maxShapes", value_name = "NAME:DIMS", value_parser = shapes_parser, requires_all = ["min_shapes", "opt_shapes"])]
    pub max_shapes: Option<Shapes>,
}

/// What `bench` and `profile` run: a bundled model, a graph file or an engine file (also by
/// `--loadEngine`), with its weights and input shape.
#[derive(Args, Debug)]
pub struct TargetArgs {
    #[arg(help = model_help(), required_unless_present = "load_engine")]
    pub model: Option<String>,
    /// trtexec's way to name an engine file (the same as giving it as the model).
    #[arg(long = "loadEngine", value_name = "FILE", conflicts_with = "model")]
    pub load_engine: Option<PathBuf>,
    /// Weights for a bundled model, safetensors or .pth (default: seeded; digits_resnet: its trained weights).
    #[arg(long, value_name = "FILE")]
    pub weights: Option<PathBuf>,
    /// Input height and width for a bundled model (default: the model's).
    #[arg(long, value_name = "PIXELS")]
    pub size: Option<usize>,
    /// The input's shape, `input:NxCxHxW`: its N is the batch (instead of --batch).
    #[arg(long, value_name = "NAME:DIMS", value_parser = shapes_parser, conflicts_with = "batch")]
    pub shapes: Option<Shapes>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Batch sizes, comma-separated; a bundled model or graph file gets one engine per batch; an engine file runs each within its range.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<usize>,
    /// Warm-up time before timing, in milliseconds (trtexec: --warmUp 200).
    #[arg(long, value_name = "MS", default_value_t = 200, visible_alias = "warmUp")]
    pub warmup: u64,
    /// Minimum number of timed runs (trtexec: 10).
    #[arg(long, default_value_t = 10)]
    pub iterations: usize,
    /// Minimum total timed duration, in seconds (trtexec: 3).
    #[arg(long, value_name = "S", default_value_t = 3.0)]
    pub duration: f64,
    /// Extra latency percentiles to report, comma-separated (trtexec: --percentile=90,95,99).
    #[arg(long, value_name = "P", value_delimiter = ',')]
    pub percentile: Vec<f64>,
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
    /// Write every timed run's latency as JSON to FILE (trtexec: --exportTimes).
    #[arg(long, value_name = "FILE", visible_alias = "exportTimes")]
    pub export_times: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub target: TargetArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Images in the batch profiled (an engine file: within its batch range).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Back-to-back replays of each layer (captured alone in a CUDA graph); its time is their mean.
    #[arg(long, default_value_t = 50)]
    pub iterations: usize,
    /// Show only the N slowest layers (0: all).
    #[arg(long, default_value_t = 0)]
    pub top: usize,
    /// Write every layer's time as JSON to FILE (trtexec: --exportProfile).
    #[arg(long, value_name = "FILE", visible_aliases = ["export-profile", "exportProfile"])]
    pub json: Option<PathBuf>,
    /// Write every layer's time as CSV to FILE.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct CompareArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Reference safetensors from tools/export_reference.py (`input`, `output.<name>`, `intermediate.<module path>` for --layerwise), or outputs saved by --save-outputs (Polygraphy: --load-outputs).
    #[arg(long, value_name = "FILE", visible_alias = "load-outputs")]
    pub reference: Option<PathBuf>,
    /// Write the input and this run's outputs (with metadata) to FILE, in the reference format.
    #[arg(long, value_name = "FILE")]
    pub save_outputs: Option<PathBuf>,
    /// Write the comparison as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Relative L2 tolerance per output (default: 1e-5 on the CPU, 1e-4 FP32, 2e-3 TF32, 1e-2 FP16).
    #[arg(long, value_name = "TOL")]
    pub l2_tol: Option<f64>,
    /// Elementwise absolute tolerance: |out - ref| <= atol + rtol * |ref| (Polygraphy's rule; checked when --atol or --rtol is given, the other defaulting to 0).
    #[arg(long, value_name = "TOL")]
    pub atol: Option<f64>,
    /// Elementwise relative tolerance (see --atol).
    #[arg(long, value_name = "TOL")]
    pub rtol: Option<f64>,
    /// Images in the random input when there is no reference (default 1).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Seed of the random input when there is no reference (default 0, so two runs see one input).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Compare on the CPU reference executor instead of an engine.
    #[arg(long)]
    pub cpu: bool,
    /// Compare every intermediate in the reference and name the first layer whose error jumps.
    #[arg(long, requires = "reference")]
    pub layerwise: bool,
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Images in the batch the graph is traced at (and the engine built for): default 1, or --shapes's N.
    #[arg(long)]
    pub batch: Option<usize>,
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
    /// Name of the generated function, `fn(vb, batch: usize) -> Result<Graph>` (structured: `vb: VarBuilder`; flat: `&VarBuilder`).
    #[arg(long, default_value = "build")]
    pub fn_name: String,
    /// The flat op list (`Tensor::record` calls) instead of Kiln modules.
    #[arg(long)]
    pub flat: bool,
    /// Line width to lay the code out for (rustfmt's max_width).
    #[arg(long, default_value_t = 100)]
    pub max_width: usize,
    /// Lay out for rustfmt's `use_small_heuristics = "Max"` (Kiln's own style) instead of the default.
    #[arg(long)]
    pub small_heuristics_max: bool,
}

/// The `kiln` command line with the bundled models only.
pub fn main() -> ExitCode {
    main_with(&[])
}

/// The whole `kiln` command line for a program with its own models: each `(name, trace_fn)` is
/// accepted wherever a bundled model's name is (and shadows a bundled model of the same name).
///
/// ```no_run
/// use kiln::{Graph, Result, VarBuilder};
/// fn mynet(vb: VarBuilder, batch: usize, hw: Option<[usize; 2]>) -> Result<Graph> {
///     # let _ = (vb, batch, hw); unimplemented!()
/// }
/// fn main() -> std::process::ExitCode {
///     kiln_cli::main_with(&[("mynet", mynet)])
/// }
/// ```
pub fn main_with(models: &[(&str, TraceFn)]) -> ExitCode {
    run_with(std::env::args_os(), models)
}

/// `main_with` on given arguments (the first is the program name), for tests and embedding.
pub fn run_with<I, T>(args: I, models: &[(&str, TraceFn)]) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are "errors" that print to standard output and succeed.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    init_logging(cli.verbose, cli.quiet);
    common::set_user_models(models);
    let verbose = cli.verbose > 0;
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Trace(a) => run::trace(a),
        Command::Build(a) => run::build(a, verbose),
        Command::Bench(a) => bench::bench(a),
        Command::Profile(a) => bench::profile(a),
        Command::Compare(a) => compare::compare(a),
        Command::Inspect(a) => inspect::inspect(a),
        Command::Codegen(a) => inspect::codegen(a),
        Command::Calibrate(a) => calibrate::calibrate(a),
        Command::Models(a) => models::models(a),
        Command::TritonRepo(a) => triton::triton_repo(a),
    };
    match result {
        Ok(code) => code,
        // The reader of our output went away (`| head -1`): what it wanted, it got.
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            // The one message that is not a log line: it is the command's result.
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Diagnostics to standard error through `tracing`: `RUST_LOG` (an EnvFilter, e.g.
/// `kiln=debug`) when set, else notes and warnings (`-q`: errors only; `-v`: debug; `-vv`: trace).
/// Without -v or RUST_LOG, lines are the bare message (`note: ...`), as before logging existed.
fn init_logging(verbose: u8, quiet: bool) {
    use tracing_subscriber::EnvFilter;
    let from_env = std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty());
    let default = match (quiet, verbose) {
        (true, _) => "error",
        (_, 0) => "info",
        (_, 1) => "debug",
        _ => "trace",
    };
    let filter = from_env.as_deref().map(EnvFilter::new).unwrap_or_else(|| EnvFilter::new(default));
    let detailed = verbose > 0 || from_env.is_some();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .without_time()
        .with_level(detailed)
        .with_target(detailed);
    // A second call in one process (tests embedding the CLI) keeps the first subscriber.
    let _ = builder.try_init();
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

    #[test]
    fn tactic_sources_reach_the_build_config() {
        let cli = Cli::try_parse_from(["kiln", "build", "resnet50", "--int8", "--tactic-sources", "kernel:conv8,cudnn", "-o", "r.kiln"])
            .expect("parse");
        let Command::Build(b) = cli.command else { panic!("not a build") };
        let sources = b.engine.config(1, 1, 1).tactic_sources;
        assert_eq!(sources, Some(vec!["kernel:conv8".to_string(), "cudnn".to_string()]));
        let none = Cli::try_parse_from(["kiln", "build", "resnet50", "-o", "r.kiln"]).expect("parse");
        let Command::Build(b) = none.command else { panic!("not a build") };
        assert_eq!(b.engine.config(1, 1, 1).tactic_sources, None, "no flag: every algorithm is timed");
    }

    #[test]
    fn every_help_example_parses() {
        let mut all: Vec<String> = EXAMPLES.iter().map(|e| e.to_string()).collect();
        for sub in Cli::command().get_subcommands() {
            let help = sub.get_after_long_help().map(|h| h.to_string()).unwrap_or_default();
            all.extend(help.lines().map(str::trim).filter(|l| l.starts_with("kiln ")).map(str::to_string));
        }
        assert!(all.len() > 20, "{all:?}");
        for line in &all {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let Err(e) = Cli::try_parse_from(&words) {
                panic!("example `{line}` does not parse: {e}");
            }
        }
    }
}
