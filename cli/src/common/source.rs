//! What a command's model argument names: a program's own model, a bundled model, a graph file
//! or an engine file.

use crate::TraceFn;
use kiln::files::FileKind;
use kiln::{Error, Result};
use std::path::PathBuf;
use std::sync::Mutex;

/// The models a program added with `main_with`, by name.
static USER_MODELS: Mutex<Vec<(String, TraceFn)>> = Mutex::new(Vec::new());

pub fn set_user_models(models: &[(&str, TraceFn)]) {
    let mut m = USER_MODELS.lock().unwrap_or_else(|p| p.into_inner());
    *m = models.iter().map(|(n, f)| (n.to_string(), *f)).collect();
}

/// The names of the models a program added with `main_with`.
pub fn user_model_names() -> Vec<String> {
    USER_MODELS.lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(n, _)| n.clone()).collect()
}

fn user_model(name: &str) -> Option<TraceFn> {
    USER_MODELS.lock().unwrap_or_else(|p| p.into_inner()).iter().find(|(n, _)| n == name).map(|(_, f)| *f)
}

/// What a command's model argument names.
#[derive(Clone, Debug)]
pub enum Source {
    User(String, TraceFn),
    Bundled(&'static kiln_models::BundledModel),
    GraphFile(PathBuf),
    EngineFile(PathBuf),
}

/// Decides what `arg` names: a program's own model, a bundled model, then a file by its content
/// (`kiln::files::kind`: the engine magic `KILNENG`, or a safetensors header holding the graph;
/// its name does not matter); anything else is an error listing what is accepted.
pub fn source(arg: &str) -> Result<Source> {
    if let Some(f) = user_model(arg) {
        return Ok(Source::User(arg.to_string(), f));
    }
    if let Ok(info) = kiln_models::bundled(arg) {
        return Ok(Source::Bundled(info));
    }
    let path = PathBuf::from(arg);
    if !path.exists() {
        if arg.ends_with(".kiln") || arg.ends_with(".safetensors") || arg.contains(std::path::MAIN_SEPARATOR) {
            return Err(Error::Io { path, source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file") });
        }
        let mut known = kiln_models::bundled_names();
        let users = user_model_names();
        if !users.is_empty() {
            known = format!("{known}; this program's own: {}", users.join(", "));
        }
        return Err(Error::UnknownModel { name: arg.to_string(), known });
    }
    match kiln::files::kind(&path) {
        FileKind::Engine => Ok(Source::EngineFile(path)),
        // A safetensors file without a graph, a directory or a FIFO: the graph-file reader says
        // what it is (a state_dict goes to --weights; only a regular file is read).
        FileKind::Graph | FileKind::Safetensors => Ok(Source::GraphFile(path)),
        FileKind::Other if !path.is_file() => Ok(Source::GraphFile(path)),
        FileKind::Other => Err(Error::GraphFile {
            path: arg.to_string(),
            reason: "is neither a graph file (.kiln.safetensors by convention, from `kiln trace`: a safetensors file whose metadata holds `kiln.graph`) \
                     nor an engine file (.kiln by convention, from `kiln build`: it starts with KILNENG)"
                .into(),
        }),
    }
}

/// Whether a command's model argument names an engine file.
pub fn is_engine_file(arg: &str) -> bool {
    matches!(source(arg), Ok(Source::EngineFile(_)))
}
