#!/usr/bin/env bash
# Builds the GPU test binaries and the kiln CLI here (the device has no Rust toolchain) and stages
# them, with the Python tools, in .carry/ for `bash tools/gpu-test.sh` and `bash tools/bench-all.sh`
# on the device (docs/ENGINE.md, docs/BENCHMARKS.md). .carry/ is git-ignored and must stay under the
# device tool's 64 MiB limit, so binaries are stripped (and with XZ=1 compressed).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
for d in /.carry/ /.whl/; do grep -qx "$d" "$exclude" 2>/dev/null || echo "$d" >> "$exclude"; done
rm -rf .carry && mkdir -p .carry/bin .carry/tools .carry/kiln
# Every test binary of the kiln crate, kiln-vision and the plugin crates whose name starts with gpu_ (and
# engine-level no-GPU tests).
cargo test --release -p kiln -p kiln-deform-conv -p kiln-vision --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"]
        if name.startswith("gpu_") or name in ("engine_registry",):
            print(name, m["executable"])
' | while read -r name exe; do
    cp "$exe" ".carry/bin/$name"
    strip ".carry/bin/$name"
  done
# The CLI for tools/bench-all.sh, and the commit it was built from (for the benchmark write-up).
XZ=${XZ:-0} bash tools/stage-cli.sh
cp tools/*.py .carry/tools/
[ -f ../shared/bench/torch_peer.py ] && cp ../shared/bench/torch_peer.py .carry/tools/
# XZ=1: binaries compressed (about a quarter of their size), so that the staged folder and the
# tree fit a 64 MiB upload; tools/carry-unpack.sh (sourced by the GPU-side scripts) restores them.
if [ "${XZ:-0}" = 1 ]; then
  xz -f -T0 -6 .carry/bin/*
fi
ls -la .carry/bin .carry/kiln
du -sh .carry
