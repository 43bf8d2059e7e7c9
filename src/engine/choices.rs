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
    /// Build progress callback (see `Progress`).
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

    /// Writes the timing cache to `path`, with the entries another build wrote there since this
    /// one read it (this build's win where both timed a choice), through a temporary file and a
    /// rename: builds running side by side on one cache file never leave half a file.
    pub fn save_cache(&self, path: &Path) -> Result<()> {
        let mut merged = Tactics::default();
        // A file that is missing or no longer valid JSON is written afresh.
        let _ = merged.load_cache(path);
        merged.cache.extend(self.cache.iter().map(|(k, v)| (k.clone(), v.clone())));
        let json = serde_json::to_vec_pretty(&merged.cache)
            .map_err(|e| Error::Serialize { what: "the timing cache".into(), reason: e.to_string() })?;
        crate::host::write_atomically(path, &json).map_err(Error::io(path))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn tactics(entries: &[(&str, &str)]) -> Tactics {
        Tactics { cache: entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), ..Default::default() }
    }

    #[test]
    fn builds_sharing_a_timing_cache_keep_each_others_entries() {
        let dir = std::env::temp_dir().join(format!("kiln-timing-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("timing.json");
        tactics(&[("h200|fp16|b1|conv a", "cudnn:1"), ("h200|fp16|b1|conv b", "cudnn:2")]).save_cache(&path).unwrap();
        // A second build that read the file before the first wrote it: its entries win where both timed.
        tactics(&[("h200|fp16|b1|conv b", "kernel:x"), ("h200|fp16|b1|conv c", "cublaslt:3")]).save_cache(&path).unwrap();
        let mut read = Tactics::default();
        read.load_cache(&path).unwrap();
        let want =
            tactics(&[("h200|fp16|b1|conv a", "cudnn:1"), ("h200|fp16|b1|conv b", "kernel:x"), ("h200|fp16|b1|conv c", "cublaslt:3")]);
        assert_eq!(read.cache, want.cache);
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["timing.json"]);
        // A file that is not JSON is refused when read, and replaced when written.
        std::fs::write(&path, b"{ half").unwrap();
        assert!(Tactics::default().load_cache(&path).is_err());
        tactics(&[("k", "v")]).save_cache(&path).unwrap();
        let mut read = Tactics::default();
        read.load_cache(&path).unwrap();
        assert_eq!(read.cache, tactics(&[("k", "v")]).cache);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
