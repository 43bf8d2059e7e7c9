//! What the CLI's test binaries share: the `kiln` binary (cargo's, or `KILN_BIN` where a test
//! binary was carried to another machine with the CLI beside it), run with extra environment or
//! without, its output as text, the check of a clean failure, and temporary folders.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn kiln_exe() -> PathBuf {
    std::env::var_os("KILN_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_kiln")), PathBuf::from)
}

/// `kiln args` with `env` added (and the caller's `RUST_LOG` removed, so its logging is the
/// test's choice).
pub fn kiln_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(kiln_exe()).env_remove("RUST_LOG").args(args).envs(env.iter().copied()).output().expect("run the kiln binary")
}

pub fn kiln(args: &[&str]) -> Output {
    kiln_env(args, &[])
}

/// Standard output and standard error.
pub fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Asserts `kiln args` fails with exit status 1 (an error, not a panic's 101 or an abort's 134)
/// and that its stderr contains every one of `says`; returns stderr.
pub fn fails_with(args: &[&str], says: &[&str]) -> String {
    fails_with_env(args, &[], says)
}

pub fn fails_with_env(args: &[&str], env: &[(&str, &str)], says: &[&str]) -> String {
    let out = kiln_env(args, env);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "kiln {args:?}: expected exit 1\nstdout: {stdout}\nstderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for s in says {
        assert!(stderr.contains(s), "kiln {args:?}: expected `{s}` in stderr: {stderr}");
    }
    stderr
}

/// A fresh folder for one test: `kiln-<test binary>-<name>-<process id>` in the system's
/// temporary folder.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-{}-{name}-{}", env!("CARGO_CRATE_NAME"), std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// A path as a command-line argument.
pub fn arg(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}
