#!/usr/bin/env bash
# The import corpus on the device (tools/import_corpus.py --gpu, docs/IMPORT.md "The import corpus"):
# one process per GPU, each on its own shard of the models not yet run there (by the carried
# docs/import_corpus.json), all stopping cleanly before BUDGET seconds so that a 10-minute call
# keeps every row. Each model is exported at batch 2 on the device (no graph file is uploaded).
#
#   here:    bash tools/gpu-build.sh                          stages the kiln CLI in .carry/kiln/
#            wheels in .whl-corpus/ (docs/IMPORT.md lists them; pip download, never committed)
#   device:  bash tools/import-corpus-gpu.sh                  carry [".carry", ".whl-corpus"], timeout_s 600
#            COMPILE=1 bash tools/import-corpus-gpu.sh        the torch.compile run instead (its own calls)
#   here:    python3 tools/import_corpus.py --merge docs/import_corpus.json <files_at>/corpus-*/results.json
#
# Environment: BUDGET (seconds for the call, default 510), GPUS (default: every GPU nvidia-smi lists),
# KILN (default .carry/kiln/kiln), WHEELS (default .whl-corpus). Extra arguments go to import_corpus.py
# (e.g. model names, --dry-run to run the plumbing on the CPU).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$(mktemp -d)}
BUDGET=${BUDGET:-510}
KILN=${KILN:-.carry/kiln/kiln}
WHEELS=${WHEELS:-.whl-corpus}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=1 TORCHINDUCTOR_FREEZING=1
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
THREADS=$(($(nproc) / GPUS))
((THREADS >= 1)) || THREADS=1
MODE=(--gpu)
[ -n "${COMPILE:-}" ] && MODE=(--compile)
pids=()
for ((k = 1; k <= GPUS; k++)); do
  mkdir -p "$OUT/corpus-$k"
  CUDA_VISIBLE_DEVICES=$((k - 1)) python3 tools/import_corpus.py "${MODE[@]}" --kiln "$KILN" --shard "$k/$GPUS" \
    --budget "$BUDGET" --threads "$THREADS" --resume-from docs/import_corpus.json --out "$OUT/corpus-$k" "$@" \
    >"$OUT/corpus-$k/log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
for ((k = 1; k <= GPUS; k++)); do
  echo "== shard $k/$GPUS"
  grep -E '^\[|^Corpus|^torch.compile|^import_corpus' "$OUT/corpus-$k/log" | tail -40
  rm -f "$OUT/corpus-$k"/*.safetensors "$OUT/corpus-$k"/*.json.tmp
done
exit $rc
