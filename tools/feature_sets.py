#!/usr/bin/env python3
"""Lists the dependencies whose features differ between the commands a user runs.

Cargo resolves features per command: `cargo test` adds the dev-dependencies' features, and
`cargo build -p kiln-triton` leaves out those of the crates it does not build. A dependency built
with other features is compiled again, with everything above it (kiln and every crate on kiln).
hack/Cargo.toml (the crate `kiln-workspace-hack`, which kiln depends on) asks for the union of
those features, so that every command builds each crate once.

This script asks `cargo tree` (no compiling) for the feature set of every dependency under each
command (the workspace, and each member alone, with and without dev-dependencies) and prints the
dependencies whose sets differ, with the union to put in hack/Cargo.toml. Exit status 1 if any.

    python3 tools/feature_sets.py
"""
import collections
import json
import subprocess
import sys


def members():
    meta = json.loads(subprocess.run(["cargo", "metadata", "--no-deps", "--format-version", "1"], check=True, capture_output=True, text=True).stdout)
    # The proc-macro crate and the hack itself are never built alone by a README command.
    return [p["name"] for p in meta["packages"] if p["name"] not in ("kiln-workspace-hack", "kiln-macros")]


def feature_sets(selection):
    """{package: features} under one command's selection (`--workspace`, `-p NAME`), both edges kinds."""
    out = subprocess.run(
        ["cargo", "tree", *selection, "-f", "{p}|{f}", "--prefix", "none", "--no-dedupe"], check=True, capture_output=True, text=True
    ).stdout
    sets = {}
    for line in out.splitlines():
        line = line.replace(" (*)", "")
        if "|" not in line:
            continue
        package, features = line.split("|", 1)
        if "(/" in package:  # a workspace member: its own features are not unified by the hack
            continue
        package = package.replace(" (proc-macro)", "").strip()
        sets.setdefault(package, set()).update(f for f in features.strip().split(",") if f)
    return sets


def main():
    commands = [["--workspace", "-e", "normal,build"], ["--workspace", "-e", "normal,build,dev"]]
    for m in members():
        commands += [["-p", m, "-e", "normal,build"], ["-p", m, "-e", "normal,build,dev"]]
    seen = collections.defaultdict(set)
    for c in commands:
        for package, features in feature_sets(c).items():
            seen[package].add(frozenset(features))
    differing = {p: s for p, s in seen.items() if len(s) > 1}
    for package, sets in sorted(differing.items()):
        union = sorted(set().union(*sets))
        print(f"{package}: features differ between commands; the union is {', '.join(union)}")
    print(f"{len(seen)} dependencies over {len(commands)} commands: {len(differing)} with differing features")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
