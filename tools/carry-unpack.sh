#!/usr/bin/env bash
# Decompresses the binaries tools/gpu-build.sh staged as .xz (XZ=1 there), in place: sourced by the
# scripts that run on the GPU machine, a no-op when nothing is compressed.
for f in .carry/bin/*.xz .carry/kiln/*.xz; do
  [ -e "$f" ] || continue
  xz -d -f -T0 "$f" && chmod +x "${f%.xz}"
done
