//! The host system as Kiln meets it: user paths opened without ever blocking on one that is not a
//! regular file.

use crate::{Error, Result};
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

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

/// The whole of a regular file (see [`open_regular`]).
pub fn read_regular(path: &Path, give: &str, wrong_kind: impl FnOnce(String) -> Error) -> Result<Vec<u8>> {
    let mut file = open_regular(path, give, wrong_kind)?;
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut file, &mut bytes).map_err(Error::io(path))?;
    Ok(bytes)
}

/// A regular file mapped read-only (see [`open_regular`]): only the pages read are loaded, so a
/// header can be checked before a large file's data is touched.
pub fn map_regular(path: &Path, give: &str, wrong_kind: impl FnOnce(String) -> Error) -> Result<memmap2::Mmap> {
    let file = open_regular(path, give, wrong_kind)?;
    // SAFETY: the file is opened read-only; like every mmap user we assume nobody truncates it
    // while it is read.
    unsafe { memmap2::Mmap::map(&file) }.map_err(Error::io(path))
}
