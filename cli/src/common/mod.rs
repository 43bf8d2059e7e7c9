//! What the commands share: finding the model a command names (a bundled or user model, a graph
//! file, an engine file), tracing it with its weights, making or reading an input, building or
//! loading an engine (with a progress bar), and summarising outputs for people.
//!
//! - `source`: what a model argument names (and the models a program added with `main_with`);
//! - `load`: tracing or reading that model with its weights ([`Traced`]);
//! - `dims`: the batch and size the flags ask for, checked before anything is allocated;
//! - `inputs`: the model's inputs, and random or file data for them;
//! - `memory`: whether a CPU run fits in the memory available;
//! - `engine`: building or loading an engine;
//! - `summary`: outputs and timings as people read them.

mod dims;
mod engine;
mod inputs;
mod load;
mod memory;
mod source;
mod summary;

pub use dims::{check_shapes, requested, MAX_INPUT_ELEMENTS};
pub use engine::{build_engine, engine_for, gpu, progress_bar};
pub use inputs::{bind, engine_inputs, graph_inputs, random_inputs, read_input, read_input_data, InputData};
pub use load::{load, load_args, trace_args, Traced};
pub use memory::check_cpu_memory;
pub use source::{is_engine_file, set_user_models, source, user_model_names, Source};
pub use summary::{class_scores_output, ms, summarize};
