//! Issue 42's first contact, problem 8: each example's `--help` prints its usage and exits 0 (it
//! exited 1). `cargo test` builds the examples beside the test binaries (`target/<profile>/examples`).

use std::path::PathBuf;
use std::process::Command;

fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary");
    let dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>").join("examples");
    dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}

#[test]
fn each_example_help_prints_its_usage_and_exits_0() {
    for name in ["classify", "detect", "embed"] {
        let path = example(name);
        assert!(path.exists(), "{} is not built: `cargo test` builds the examples", path.display());
        for flag in ["--help", "-h"] {
            let out = Command::new(&path).arg(flag).output().expect("run the example");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "{name} {flag} exits {:?}: {stdout}", out.status.code());
            assert!(stdout.starts_with(&format!("usage: {name}")), "{name} {flag}: {stdout}");
        }
    }
}
