//! The host system as Kiln meets it: user paths opened without ever blocking on one that is not a
//! regular file, and the memory this process may still use (what the kernel has free, and what
//! `ulimit` and the memory cgroup allow).

use crate::{Error, Result};
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// What a path is, in a message, when it is not a regular file.
fn not_a_file(meta: &std::fs::Metadata) -> Option<&'static str> {
    if meta.is_file() {
        None
    } else if meta.is_dir() {
        Some("a directory")
    } else {
        Some("not a regular file (a FIFO, socket or device)")
    }
}

/// Opens a user's `path` for reading if it is a regular file.
///
/// The path is opened with `O_NONBLOCK` (opening a FIFO for reading would otherwise wait for a
/// writer) and `O_NOCTTY`, then checked with `fstat` on the open descriptor, so a path swapped
/// between a check and the open cannot slip through. On a regular file `O_NONBLOCK` has no effect.
/// A directory, FIFO, socket or device gives `wrong_kind("is a directory; give <give>")` (the
/// caller's error kind, which names the file's role); any other failure is `Error::Io` naming it.
pub fn open_regular(path: &Path, give: &str, wrong_kind: impl FnOnce(String) -> Error) -> Result<File> {
    let file =
        std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY).open(path).map_err(Error::io(path))?;
    let meta = file.metadata().map_err(Error::io(path))?;
    match not_a_file(&meta) {
        None => Ok(file),
        Some(what) => Err(wrong_kind(format!("is {what}; give {give}"))),
    }
}

/// The whole of a regular file (see [`open_regular`]). Its size (from `fstat`) is checked against
/// the memory this process may still use and requested with `try_reserve` before anything is
/// read, so a file larger than memory is an `Error::OutOfMemory` naming it, not an abort.
pub fn read_regular(path: &Path, give: &str, wrong_kind: impl FnOnce(String) -> Error) -> Result<Vec<u8>> {
    let file = open_regular(path, give, wrong_kind)?;
    let len = file.metadata().map_err(Error::io(path))?.len();
    let too_large = |available: Option<Available>| Error::OutOfMemory {
        what: format!(
            "reading {}{}",
            path.display(),
            available.map_or(String::new(), |a| format!(" (only {} bytes are available ({}))", a.bytes, a.limit))
        ),
        bytes: usize::try_from(len).unwrap_or(usize::MAX),
    };
    let n = usize::try_from(len).map_err(|_| too_large(None))?;
    if let Some(a) = memory_available().filter(|a| a.bytes < n) {
        return Err(too_large(Some(a)));
    }
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(n).map_err(|_| too_large(None))?;
    // No more than `fstat` said: a file that grows while it is read does not grow the buffer.
    std::io::Read::read_to_end(&mut std::io::Read::take(file, len), &mut bytes).map_err(Error::io(path))?;
    Ok(bytes)
}

/// Writes `bytes` to `path` through a temporary file beside it and a rename, so that a reader,
/// or another process writing the same file, never sees half of it.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// A regular file mapped read-only (see [`open_regular`]): only the pages read are loaded, so a
/// header can be checked before a large file's data is touched.
pub fn map_regular(path: &Path, give: &str, wrong_kind: impl FnOnce(String) -> Error) -> Result<memmap2::Mmap> {
    let file = open_regular(path, give, wrong_kind)?;
    // SAFETY: the file is opened read-only; like every mmap user we assume nobody truncates it
    // while it is read.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|e| match e.raw_os_error() {
        // A file larger than the address space left (`ulimit -v`) cannot be mapped at all.
        Some(libc::ENOMEM) => Error::OutOfMemory {
            what: format!(
                "mapping {}{}",
                path.display(),
                memory_available().map_or(String::new(), |a| format!(" (only {} bytes are available ({}))", a.bytes, a.limit))
            ),
            bytes: file.metadata().map_or(usize::MAX, |m| usize::try_from(m.len()).unwrap_or(usize::MAX)),
        },
        _ => Error::io(path)(e),
    })
}

/// How much memory this process may still allocate, and which limit says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Available {
    pub bytes: usize,
    /// The limit that gave `bytes`: `MemAvailable`, `ulimit -v`, `ulimit -d`, `cgroup memory.max`,
    /// `cgroup memory.limit_in_bytes` or `KILN_CPU_MEMORY_BYTES`.
    pub limit: &'static str,
}

/// The memory this process may still allocate: `KILN_CPU_MEMORY_BYTES` when set (an override for
/// tests, taken as it is), else the smallest of
/// - the kernel's `MemAvailable`;
/// - the address-space limit (`RLIMIT_AS`, `ulimit -v`) less the process's mapped size (`VmSize`),
///   and the data limit (`RLIMIT_DATA`, `ulimit -d`) less its data size (`VmData`);
/// - for the process's memory cgroup and each cgroup above it: v2's `memory.max` less
///   `memory.current`, or v1's `memory.limit_in_bytes` less `memory.usage_in_bytes`, with the
///   reclaimable page cache (`inactive_file`) not counted as used.
///
/// `None` when none of them is known (then nothing can be checked).
pub fn memory_available() -> Option<Available> {
    if let Some(bytes) = std::env::var("KILN_CPU_MEMORY_BYTES").ok().and_then(|v| v.parse().ok()) {
        return Some(Available { bytes, limit: "KILN_CPU_MEMORY_BYTES" });
    }
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let status = read(Path::new("/proc/self/status")).unwrap_or_default();
    let mut known = Vec::new();
    if let Some(kb) = read(Path::new("/proc/meminfo")).and_then(|m| kib_field(&m, "MemAvailable:")) {
        known.push(Available { bytes: kb.saturating_mul(1024), limit: "MemAvailable" });
    }
    for (resource, field, limit) in [(libc::RLIMIT_AS, "VmSize:", "ulimit -v"), (libc::RLIMIT_DATA, "VmData:", "ulimit -d")] {
        if let (Some(max), Some(used)) = (rlimit(resource), kib_field(&status, field)) {
            known.push(Available { bytes: max.saturating_sub(used.saturating_mul(1024)), limit });
        }
    }
    let cgroups = read(Path::new("/proc/self/cgroup")).unwrap_or_default();
    known.extend(cgroup_available(Path::new("/sys/fs/cgroup"), &cgroups, read));
    known.into_iter().min_by_key(|a| a.bytes)
}

/// The soft limit of `resource`, `None` where it is unlimited or unknown.
fn rlimit(resource: libc::__rlimit_resource_t) -> Option<usize> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid, writable rlimit for the call to fill.
    let rc = unsafe { libc::getrlimit(resource, &mut lim) };
    (rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY).then(|| usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX))
}

/// A `Name:   123 kB` field of `/proc/meminfo` or `/proc/self/status`, in KiB.
fn kib_field(text: &str, name: &str) -> Option<usize> {
    text.lines().find_map(|l| l.strip_prefix(name))?.split_whitespace().next()?.parse().ok()
}

/// A cgroup v1 limit at or above this means "no limit" (the kernel reports 2^63 rounded to pages).
const CGROUP_V1_UNLIMITED: usize = 1 << 60;

/// What the memory cgroups of this process leave: for the v2 hierarchy and the v1 `memory`
/// controller named in `self_cgroup` (the text of `/proc/self/cgroup`), under `root`, the tightest
/// `limit - (usage - inactive_file)` of the process's cgroup and every cgroup above it (a limit
/// set higher up binds too). Inside a container the path may name a cgroup the container cannot
/// see; its missing levels are skipped and the visible root still counts.
fn cgroup_available(root: &Path, self_cgroup: &str, read: impl Fn(&Path) -> Option<String>) -> Option<Available> {
    let mut best: Option<Available> = None;
    for line in self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let (dir, files, limit) = if controllers.is_empty() {
            (root.to_path_buf(), ["memory.max", "memory.current", "inactive_file "], "cgroup memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                root.join("memory"),
                ["memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file "],
                "cgroup memory.limit_in_bytes",
            )
        } else {
            continue;
        };
        let mut levels: Vec<PathBuf> = Path::new(path.trim()).ancestors().map(|a| dir.join(a.strip_prefix("/").unwrap_or(a))).collect();
        levels.dedup();
        for level in levels {
            let number = |name: &str| read(&level.join(name)).and_then(|t| t.trim().parse::<usize>().ok());
            // v2 writes `max` for no limit, v1 a number near 2^63.
            let Some(max) = number(files[0]).filter(|&m| m < CGROUP_V1_UNLIMITED) else { continue };
            let usage = number(files[1]).unwrap_or(0);
            let cache = read(&level.join("memory.stat"))
                .and_then(|s| s.lines().find_map(|l| l.strip_prefix(files[2]).and_then(|v| v.trim().parse::<usize>().ok())))
                .unwrap_or(0);
            let bytes = max.saturating_sub(usage.saturating_sub(cache));
            if best.is_none_or(|b| bytes < b.bytes) {
                best = Some(Available { bytes, limit });
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn fake(files: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let files: BTreeMap<PathBuf, String> = files.iter().map(|(p, t)| (PathBuf::from(p), t.to_string())).collect();
        move |p: &Path| files.get(p).cloned()
    }

    #[test]
    fn cgroup_v2_limits_bind_at_every_level_and_page_cache_is_not_used_memory() {
        let files = fake(&[
            ("/cg/memory.max", "max\n"),
            ("/cg/user/memory.max", "4000000000\n"),
            ("/cg/user/memory.current", "1000000000\n"),
            ("/cg/user/memory.stat", "anon 1\ninactive_file 500000000\nactive_file 7\n"),
            ("/cg/user/job/memory.max", "max\n"),
            ("/cg/user/job/memory.current", "900000000\n"),
        ]);
        let got = cgroup_available(Path::new("/cg"), "0::/user/job\n", files).expect("a limit");
        assert_eq!(got, Available { bytes: 3_500_000_000, limit: "cgroup memory.max" });
    }

    #[test]
    fn cgroup_v1_memory_controller_is_read_and_its_unlimited_value_ignored() {
        let files = fake(&[
            ("/cg/memory/memory.limit_in_bytes", "9223372036854771712\n"),
            ("/cg/memory/box/memory.limit_in_bytes", "2147483648\n"),
            ("/cg/memory/box/memory.usage_in_bytes", "1073741824\n"),
            ("/cg/memory/box/memory.stat", "cache 5\ntotal_inactive_file 73741824\n"),
        ]);
        let text = "9:name=systemd:/\n4:memory:/box\n1:cpu:/\n0::/\n";
        let got = cgroup_available(Path::new("/cg"), text, files).expect("a limit");
        assert_eq!(got, Available { bytes: 2_147_483_648 - 1_000_000_000, limit: "cgroup memory.limit_in_bytes" });
        // A container's own root, with the host's path invisible inside it, still counts.
        let inside = fake(&[("/cg/memory.max", "1000\n"), ("/cg/memory.current", "400\n")]);
        assert_eq!(cgroup_available(Path::new("/cg"), "0::/docker/abc\n", inside).map(|a| a.bytes), Some(600));
        assert_eq!(cgroup_available(Path::new("/cg"), "0::/\n", fake(&[("/cg/memory.max", "max\n")])), None);
    }

    #[test]
    fn status_fields_are_read_in_kib() {
        assert_eq!(kib_field("Name:\tx\nVmSize:\t  3896 kB\nVmData:\t 428 kB\n", "VmSize:"), Some(3896));
        assert_eq!(kib_field("MemTotal: 10 kB\n", "MemAvailable:"), None);
    }
}
