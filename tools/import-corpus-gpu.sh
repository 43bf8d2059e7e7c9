#!/usr/bin/env bash
# The import corpus on the device (tools/import_corpus.py --gpu, docs/IMPORT.md "The import corpus"):
# WORKERS processes per GPU share the models not yet run there (by the carried
# docs/import_corpus.json; each takes the next one no other has claimed). Every GPU step takes its
# GPU alone (CHECKS=shared lets the checks run side by side); the workers overlap what needs no GPU:
# exports, references and torch.compile's code generation. All stop cleanly before BUDGET seconds
# so that a 10-minute call keeps every row. Each model is exported at batch 2 on the device (no
# graph file is uploaded), and torch.compile is timed in the same pass for every transformer and
# every model Kiln leads by less than 1.2x (COMPILE=0 leaves it out).
#
#   here:    bash tools/gpu-build.sh                          stages the kiln CLI in .carry/kiln/
#            wheels in .whl-corpus/ (docs/IMPORT.md lists them; pip download, never committed)
#   device:  bash tools/import-corpus-gpu.sh                  carry [".carry", ".whl-corpus"], timeout_s 600
#            COMPILE=only bash tools/import-corpus-gpu.sh     torch.compile alone, for rows that lack it
#   here:    python3 tools/import_corpus.py --merge docs/import_corpus.json <files_at>/results.json
#
# Environment: BUDGET (seconds for the call, default 510), GPUS (default: every GPU nvidia-smi lists),
# WORKERS (per GPU, default 8), CHECKS (default alone: every GPU step takes the GPU alone, since
# CUDA time-slices processes and a build's tactic timing crawls beside another's; shared: the
# checks run side by side). The workers overlap what needs no GPU: exports, references and
# torch.compile's code generation.
# $OUT gets results.json (every worker's rows), log and caches.tar.xz (the compiled kernels, for the
# next call: carry it as CACHES, default .carry/caches.tar.xz); the scratch stays on the machine.
# KILN (default .carry/kiln/kiln), WHEELS (default .whl-corpus). Extra arguments go to import_corpus.py
# (e.g. model names, --dry-run to run the plumbing on the CPU). Every model Kiln trails PyTorch's
# CUDA graph on is profiled at batch 1 (`--profile-below 0` leaves it out).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$(mktemp -d)}
[ -f tools/carry-unpack.sh ] && source tools/carry-unpack.sh
BUDGET=${BUDGET:-510}
KILN=${KILN:-.carry/kiln/kiln}
WHEELS=${WHEELS:-.whl-corpus}
mkdir -p "$OUT"
# The caches of an earlier call (Kiln's NVRTC kernels, cuDNN's runtime-fusion kernels in the
# driver's cache, and the workers' shared timing cache): a fresh machine otherwise compiles the
# kernels inside the first models' GPU turns, about a minute and a half of a call, and times every
# layer again. The call's own caches go back in $OUT.
CACHES=${CACHES:-.carry/caches.tar.xz}
[ -f "$CACHES" ] && tar -xJf "$CACHES" -C ~ && echo "compiled-kernel caches from $CACHES"
# torch.compile's code generation on a few threads a worker (a DenseNet took 200 s on one).
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-2} TORCHINDUCTOR_FREEZING=1
# Kiln's subprocesses get the system cuDNN (import_corpus.py --kiln-libs); PyTorch must not see it.
unset LD_LIBRARY_PATH
# timm and segmentation_models_pytorch (and, where the image lacks them, their needs) from the
# carried wheels: pip resolves against what is installed and adds only what is missing.
if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-index --find-links "$WHEELS" --no-cache-dir --no-compile \
    timm==1.0.31 segmentation_models_pytorch==0.6.0 2>&1 | tail -3 ||
    { python3 -m pip install -q --no-index --find-links "$WHEELS" --no-cache-dir --no-compile --target /tmp/site \
        timm==1.0.31 segmentation_models_pytorch==0.6.0 && export PYTHONPATH=/tmp/site; }
fi
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
python3 -c 'import timm, segmentation_models_pytorch, torch; print("timm", timm.__version__, "smp", segmentation_models_pytorch.__version__, "torch", torch.__version__, "GPUs", torch.cuda.device_count())'

if [[ " $* " == *" --dry-run "* ]]; then
  GPUS=${GPUS:-1}
else
  GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
fi
((GPUS >= 1)) || GPUS=1
WORKERS=${WORKERS:-8}
((WORKERS >= 1)) || WORKERS=1
N=$((GPUS * WORKERS))
THREADS=$(($(nproc) / N))
((THREADS >= 1)) || THREADS=1
MODE=(--gpu --and-compile)
[ "${COMPILE:-1}" = 0 ] && MODE=(--gpu)
[ "${COMPILE:-1}" = only ] && MODE=(--compile)
[ "${CHECKS:-alone}" = alone ] && MODE+=(--checks-alone)
STATE=$(mktemp -d)  # the workers' claims on models, and each GPU's turns
pids=()
for ((k = 1; k <= N; k++)); do
  g=$(((k - 1) % GPUS))
  mkdir -p "$STATE/corpus-$k"
  # A hard stop a little after the budget, should a step ignore its own limit.
  CUDA_VISIBLE_DEVICES=$g timeout -k 5 $((${BUDGET%.*} + 40)) python3 tools/import_corpus.py "${MODE[@]}" --kiln "$KILN" \
    --claims "$STATE/claims" --turns "$STATE/turns-gpu$g" --budget "$BUDGET" --threads "$THREADS" \
    --timing-cache ~/.cache/kiln/corpus-timing-gpu$g.json \
    --resume-from docs/import_corpus.json --out "$STATE/corpus-$k" "$@" >"$STATE/corpus-$k/log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for ((k = 1; k <= N; k++)); do
  echo "== worker $k/$N (GPU $(((k - 1) % GPUS)))" | tee -a "$OUT/log"
  grep -E '^\[|^Corpus|^torch.compile|^import_corpus' "$STATE/corpus-$k/log" | tail -40
  grep -v FutureWarning "$STATE/corpus-$k/log" >>"$OUT/log"
done
# One results file for all the workers (the call brings back few files): `--merge` takes it.
python3 - "$OUT/results.json" "$STATE"/corpus-*/results.json <<'PY'
import json, sys
rows = [r for path in sys.argv[2:] for r in json.load(open(path))["models"]]
json.dump({"gpu": True, "models": rows}, open(sys.argv[1], "w"), indent=1)
print(f"{len(rows)} rows in {sys.argv[1]}")
PY
tar -cJf "$OUT/caches.tar.xz" -C ~ .cache/kiln .nv/ComputeCache 2>/dev/null || true
exit $rc
