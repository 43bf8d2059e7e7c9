#!/usr/bin/env bash
# Builds the GPU test binaries here (the device has no Rust toolchain) and stages them, with the
# Python tools, in .carry/ for `bash tools/gpu-test.sh` on the device (docs/ENGINE.md).
# .carry/ is git-ignored and must stay under the device tool's 64 MiB limit, so binaries are stripped.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
rm -rf .carry && mkdir -p .carry/bin .carry/tools
# Every test binary of the kiln crate and of the plugin crates whose name starts with gpu_ (and
# engine-level no-GPU tests).
cargo test --release -p kiln -p kiln-deform-conv --no-run --message-format=json 2>/dev/null \
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
cp tools/*.py .carry/tools/
[ -f ../shared/bench/torch_peer.py ] && cp ../shared/bench/torch_peer.py .carry/tools/
ls -la .carry/bin
du -sh .carry
