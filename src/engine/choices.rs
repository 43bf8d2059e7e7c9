//! The tactic choices a build knows and makes ([`Tactics`]): recorded in the engine, followed
//! from a profile's opt shape, cached per device, counted and logged. `engine::tactic` makes them.

use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// Called as each graph node is about to be lowered (its tactics timed) with (nodes done, nodes in
/// all, its module path): what the CLI's progress bar shows during a build.
pub type Progress = std::sync::Arc<dyn Fn(usize, usize, &str) + Send + Sync>;

#[derive(Default)]
pub struct Tactics {
    /// Choices of this engine: `"{path}|{key}"` → winning layer kind.
    pub recorded: BTreeMap<String, String>,
    /// Loading an engine: every choice must come from `recorded`; nothing is timed.
    pub replay: bool,
    /// Lowering a plan for another input shape of a profile: module path → the kind chosen at the
    /// profile's opt shape. Nothing is timed (TensorRT's rule: tactics are timed at opt): that kind
    /// if it runs at this shape, else the same algorithm in another batch slicing, else the first
    /// candidate that runs.
    pub follow: BTreeMap<String, String>,
    /// Timing cache entries: `"{device}|{precision}|b{opt}|{key}"` → kind.
    pub cache: BTreeMap<String, String>,
    pub cache_prefix: String,
    /// How many choices were timed, and how many came from the cache.
    pub timed: usize,
    pub cached: usize,
    /// Per timed choice: key and (kind, ms) of each candidate that ran, for the build log.
    pub log: TimingLog,
    /// Every choice made, in order: (module path, kind), whether timed, cached, recorded or
    /// followed (the builder takes a profile's opt choices from it).
    pub chosen: Vec<(String, String)>,
    /// Build progress callback (see [`Progress`]).
    pub progress: Option<Progress>,
    /// Where the build's seconds went, added up as it goes.
    pub build_time: super::plan::BuildTime,
}

impl Tactics {
    /// Reads a timing cache file; a missing file is an empty cache, a malformed one an error.
    pub fn load_cache(&mut self, path: &Path) -> Result<()> {
        let not_a_file = |reason| Error::EngineFile { path: path.display().to_string(), reason };
        match crate::host::read_regular(path, "the path of a JSON timing cache", not_a_file) {
            Ok(bytes) => {
                self.cache = serde_json::from_slice(&bytes).map_err(|e| Error::EngineFile {
                    path: path.display().to_string(),
                    reason: format!("timing cache is not valid JSON: {e}"),
                })?;
                Ok(())
            }
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub fn save_cache(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(&self.cache)
            .map_err(|e| Error::Serialize { what: "the timing cache".into(), reason: e.to_string() })?;
        std::fs::write(path, json).map_err(Error::io(path))
    }

    /// The counters now, so that a summary can count what comes after (`since`).
    pub(crate) fn mark(&self) -> TacticsMark {
        TacticsMark { timed: self.timed, cached: self.cached, log: self.log.len() }
    }

    /// Since `mark`: how many choices were timed, how many came from the cache, and the timing log.
    pub(crate) fn since(&self, mark: TacticsMark) -> (usize, usize, TimingLog) {
        (self.timed - mark.timed, self.cached - mark.cached, self.log[mark.log..].to_vec())
    }
}

/// A [`Tactics`]' counters at one moment ([`Tactics::mark`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TacticsMark {
    timed: usize,
    cached: usize,
    log: usize,
}

/// Per timed choice: its key and the (kind, ms) of each candidate that ran.
pub type TimingLog = Vec<(String, Vec<(String, f32)>)>;
