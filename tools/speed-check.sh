#!/usr/bin/env bash
# Issue 28's checks on the device, after `bash tools/gpu-build.sh` here (.carry/bin holds the GPU
# test binaries, .carry/kiln the CLI, .carry/tools the Python tools). Two phases, each under one
# device call's 10 minutes:
#
#   PHASE=tests bash tools/speed-check.sh   carry [".carry"]   the kernels' tests and FP16 fidelity (~6 min)
#   PHASE=bench bash tools/speed-check.sh   carry [".carry"]   kiln bench beside the PyTorch peers, profiles (~8 min)
#
# tests: exports the fidelity references (tools/export_fp16_reference.py: FP32 and PyTorch's own
#        FP16 of every bundled classifier), then runs gpu_speed (the new kernels forced, against
#        the CPU executor), gpu_depthwise and gpu_norm (the kernels' existing tests, now with the
#        new candidates timed beside the old) and gpu_fidelity (Kiln FP16 vs PyTorch FP16).
#        BINS="..." picks binaries; FIDELITY_MODELS="a,b" limits the fidelity export and test.
# bench: tools/bench_all.py for MODELS (default: vit_b_16, convnext_tiny, swin_t,
#        mobilenet_v3_large) at batch 1 and 64, Kiln FP16 under CUDA graphs beside PyTorch FP16 +
#        CUDA graph and torch.compile, then prints those rows of the tables (ratio = peer ÷ Kiln)
#        and `kiln profile` of ConvNeXt-T and ViT-B/16 at batch 64 (the layers docs/PERFORMANCE.md
#        step 9 predicts). KILN_GEMM_REDUCED_PRECISION_REDUCTION=1 runs Kiln with cuBLASLt's
#        default split-K reductions (before issue 28's fidelity fix), for an A/B.
# Logs land in $OUT (the device tool brings them back).
set -uo pipefail
cd "$(dirname "$0")/.."
KILN_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib
unset LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export KILN_FIXTURES=$PWD/tests/fixtures
KILN=$PWD/.carry/kiln/kiln
PHASE=${PHASE:-tests}
status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())'
  echo "kiln $(cat .carry/kiln/COMMIT 2>/dev/null)"; date -u
} 2>&1 | tee "$OUT/device.log"

if [ "$PHASE" = tests ]; then
  REF=$(mktemp -d)
  export KILN_REFERENCE_DIR=$REF
  t0=$(date +%s)
  python3 .carry/tools/export_fp16_reference.py --kiln "$KILN" --out "$REF/fidelity" ${FIDELITY_MODELS:+--models "$FIDELITY_MODELS"} \
    2>&1 | tee "$OUT/export.log" || echo "SOME FIDELITY EXPORTS FAILED (see export.log)"
  echo "fidelity references in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/export.log"
  [ -n "${FIDELITY_MODELS:-}" ] && export KILN_FIDELITY_MODELS=$FIDELITY_MODELS
  for name in ${BINS:-gpu_speed gpu_depthwise gpu_norm gpu_fidelity}; do
    t=.carry/bin/$name
    [ -x "$t" ] || { echo "MISSING $t" | tee -a "$OUT/tests.log"; status=1; continue; }
    echo "=== $name" | tee -a "$OUT/tests.log"
    LD_LIBRARY_PATH=$KILN_LD "$t" --include-ignored --nocapture --test-threads 1 2>&1 | tee -a "$OUT/tests.log" || status=1
  done
  echo "--- summary" | tee -a "$OUT/tests.log"
  grep -E "^test .* (ok|FAILED)$|^FIDELITY |OVER$" "$OUT/tests.log" | tee "$OUT/summary.log"
elif [ "$PHASE" = bench ]; then
  MODELS=${MODELS:-vit_b_16,convnext_tiny,swin_t,mobilenet_v3_large}
  python3 tools/bench_all.py device --kiln "$KILN" --out "$OUT/bench" --models "$MODELS" --max-autotune '' --budget "${BUDGET:-340}" \
    > "$OUT/bench.log" 2>&1 || status=1
  tail -5 "$OUT/bench.log"
  echo "--- Kiln FP16 (CUDA graphs) beside the peers; ratio = peer ÷ Kiln, > 1 is Kiln ahead"
  grep -E "^\| model " "$OUT/bench/BENCHMARKS.md" | head -1
  pat=$(echo "$MODELS" | sed 's/,/|/g')
  grep -E "^\| ($pat) \|" "$OUT/bench/BENCHMARKS.md" | sort -u | tee "$OUT/ratios.md"
  for m in convnext_tiny vit_b_16; do
    echo "--- kiln profile $m --fp16 --batch 64"
    LD_LIBRARY_PATH=$KILN_LD timeout 90 "$KILN" profile "$m" --fp16 --batch 64 --top 15 2>&1 | tee "$OUT/profile-$m.log" | tail -22
  done
else
  echo "PHASE must be tests or bench, got '$PHASE'"
  exit 2
fi
echo "exit status $status"
exit $status
