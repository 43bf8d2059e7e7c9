//! What a command's model argument names: a program's own model, a bundled model, a graph file
//! or an engine file.

use crate::TraceFn;
use kiln::files::FileKind;
use kiln::{Error, Result};
use std::path::{Path, PathBuf};
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
        if looks_like_a_file(arg) {
            return Err(Error::Io {
                path: path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, missing_file_text(&path)),
            });
        }
        let mut known = kiln_models::bundled_names();
        let users = user_model_names();
        if !users.is_empty() {
            known = format!("{known}; this program's own: {}", users.join(", "));
        }
        let names = kiln_models::BUNDLED.iter().map(|m| m.name.to_string()).chain(users);
        let names: Vec<String> = names.collect();
        let suggestion = kiln_models::closest_name(arg, names.iter().map(String::as_str)).map(str::to_string);
        return Err(Error::UnknownModel { name: arg.to_string(), suggestion, known });
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

/// Whether a model argument that names nothing was meant as a file: it has a path separator or
/// a file-like extension (`rn50.kiln.safetensor`: a dot, then letters or digits). No model name
/// has a dot.
fn looks_like_a_file(arg: &str) -> bool {
    let separator = arg.contains('/') || arg.contains(std::path::MAIN_SEPARATOR);
    let extension = arg
        .rsplit_once('.')
        .is_some_and(|(stem, ext)| !stem.is_empty() && !ext.is_empty() && ext.chars().all(|c| c.is_ascii_alphanumeric()));
    separator || extension
}

/// The most entries of a folder looked through for a near file name.
const MAX_LISTED: usize = 10_000;

/// "no such file", with the nearest file name of its folder when one is near (a typo).
fn missing_file_text(path: &Path) -> String {
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else { return "no such file".into() };
    let files: Vec<String> = std::fs::read_dir(&folder)
        .map(|entries| entries.take(MAX_LISTED).filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    match kiln_models::closest_name(name, files.iter().map(String::as_str)) {
        Some(near) => format!("no such file; did you mean {}?", folder.join(near).display()),
        None => "no such file".into(),
    }
}

/// Whether a command's model argument names an engine file.
pub fn is_engine_file(arg: &str) -> bool {
    matches!(source(arg), Ok(Source::EngineFile(_)))
}
