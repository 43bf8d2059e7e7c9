#!/usr/bin/env bash
# Builds the kiln CLI at COMMIT (default: the working tree) and stages it for the GPU machine,
# which has no cargo: .carry/kiln/kiln, stripped (XZ=1, the default: compressed to kiln.xz, which
# tools/carry-unpack.sh restores there; XZ=0 leaves it as it is, for the GPU-side scripts that do
# not unpack), and .carry/kiln/COMMIT, the commit that rows and records written with it carry. A
# commit is built in a temporary worktree with this checkout's target dir (so only Kiln's own
# crates compile again, and target/release/kiln is then that commit's): the import corpus keeps
# all its device rows at one commit while main moves on (docs/IMPORT.md, "The import corpus").
#
#   bash tools/stage-cli.sh            # the working tree (COMMIT gets -dirty if code differs from HEAD)
#   bash tools/stage-cli.sh 5a21138    # a commit, e.g. the one the corpus's device rows come from
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx "/.carry/" "$exclude" 2>/dev/null || echo "/.carry/" >> "$exclude"
target=$PWD/target
if [ $# -eq 0 ]; then
  stamp="$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!docs' || echo -dirty)"
  cargo build --release -p kiln-cli --bin kiln
else
  stamp=$(git rev-parse --short "$1^{commit}")
  src=$(mktemp -d)/kiln-$stamp
  git worktree add -q --detach "$src" "$stamp"
  trap 'git worktree remove --force "$src"' EXIT
  (cd "$src" && CARGO_TARGET_DIR="$target" cargo build --release -p kiln-cli --bin kiln)
fi
mkdir -p .carry/kiln
rm -f .carry/kiln/kiln .carry/kiln/kiln.xz
cp "$target/release/kiln" .carry/kiln/kiln
strip .carry/kiln/kiln
if [ "${XZ:-1}" = 1 ]; then
  xz -T0 -6 .carry/kiln/kiln
fi
echo "$stamp" > .carry/kiln/COMMIT
echo "staged the kiln CLI of $stamp in .carry/kiln ($(du -h .carry/kiln/kiln* | cut -f1))"
