#!/usr/bin/env bash
# A storm, a restart under load and a soak on Triton serving Kiln engines on GPU 0
# (tools/triton_gpu_storm.py says what each phase checks). Run from the repository root on a GPU
# machine; it needs no registry. Everything it uses comes from one folder, $PACK (default .qa):
#
#   triton-slim.tar.xz     tritonserver 2.51 and the libraries it links, from the nvidia-pytriton
#                          0.7.0 wheel (`tools/triton-gpu-storm.sh --pack DIR` makes the folder here)
#   py.tar.xz              tritonclient 2.51's Python package (gRPC, CUDA shared memory) and
#                          python-rapidjson, for Python 3.12; grpcio, protobuf and numpy must be there
#   kiln.xz, libtriton_kiln.so.xz   the release CLI and backend, stripped
#
# Results under $OUT/gpu-storm: the log, summary.json, soak.csv and the server logs.
# Environment: KILN_LD (CUDA 13 and cuDNN 9 for Kiln), STORM_ARGS (more flags for the Python tool,
# e.g. "--soak-s 1800").
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [[ "${1:-}" == "--pack" ]]; then
  # Here: the folder to carry. The server's libraries are the ones ldd names (not the Python
  # backend's), which keeps it under the device's upload limit.
  set -e
  DIR=${2:?give a folder}
  mkdir -p "$DIR"
  CACHE=${KILN_TRITON_CACHE:-$HOME/.cache/kiln-triton}
  SERVER_DIR="$CACHE/nvidia-pytriton-0.7.0"
  [[ -x "$SERVER_DIR/pytriton/tritonserver/bin/tritonserver" ]] || { echo "run tools/triton-test.sh once first (it unpacks the server into $SERVER_DIR)"; exit 1; }
  libs=$(cd "$SERVER_DIR" && LD_LIBRARY_PATH=$PWD/nvidia_pytriton.libs ldd pytriton/tritonserver/bin/tritonserver | awk '/nvidia_pytriton.libs/ {print $3}' | xargs -n1 basename | sed 's#^#nvidia_pytriton.libs/#')
  # shellcheck disable=SC2086
  tar -C "$SERVER_DIR" -cJf "$DIR/triton-slim.tar.xz" pytriton/tritonserver/bin/tritonserver $libs
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux1_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp" tritonclient==2.51.0 python-rapidjson==1.25
  python3 - "$tmp" <<'PY'
import glob, os, sys, zipfile
tmp = sys.argv[1]
out = os.path.join(tmp, "py")
for whl in glob.glob(os.path.join(tmp, "*.whl")):
    z = zipfile.ZipFile(whl)
    for n in z.namelist():
        # The client's Python package only (not perf_analyzer's binaries), and rapidjson's module.
        for pre in ("tritonclient-2.51.0.data/purelib/", ""):
            if n.startswith(pre) and (n[len(pre):].startswith("tritonclient/") or n.startswith("rapidjson.")):
                path = os.path.join(out, n[len(pre):])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "wb").write(z.read(n))
                break
PY
  tar -C "$tmp/py" -cJf "$DIR/py.tar.xz" .
  rm -rf "$tmp"
  cargo build --release --quiet --bin kiln -p kiln-cli
  cargo build --release --quiet -p kiln-triton --lib
  for f in kiln libtriton_kiln.so; do
    cp "target/release/$f" "$DIR/$f" && strip "$DIR/$f" && xz -f -T2 "$DIR/$f"
  done
  ls -la "$DIR"
  exit 0
fi

PACK=${PACK:-.qa}
OUT=${OUT:-$ROOT/gpu-storm-out}
mkdir -p "$OUT/gpu-storm"
LOGF="$OUT/gpu-storm/log.txt"
exec > >(tee -a "$LOGF") 2>&1
WORK=$(mktemp -d /tmp/kiln-gpu-storm.XXXXXX)
T0=$SECONDS
say() { echo "[gpu-storm $((SECONDS - T0)) s] $*"; }
KILN_LD=${KILN_LD:-/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib}

say "unpacking the server, the client and Kiln from $PACK"
mkdir -p "$WORK/server" "$WORK/py" "$WORK/backends/kiln" "$WORK/refs"
tar -xJf "$PACK/triton-slim.tar.xz" -C "$WORK/server" || exit 1
tar -xJf "$PACK/py.tar.xz" -C "$WORK/py" || exit 1
xz -dc "$PACK/kiln.xz" >"$WORK/kiln" && chmod +x "$WORK/kiln" || exit 1
xz -dc "$PACK/libtriton_kiln.so.xz" >"$WORK/backends/kiln/libtriton_kiln.so" || exit 1
KILN=$WORK/kiln
export LD_LIBRARY_PATH="$WORK/server/nvidia_pytriton.libs:$KILN_LD"
export PYTHONPATH="$WORK/py:$ROOT/tools" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c 'import grpc, google.protobuf, numpy, tritonclient.grpc; print("grpcio", grpc.__version__, "protobuf", google.protobuf.__version__)' || exit 1

say "graphs (random weights) and the repository: three models, KIND_GPU, FP32 engines"
"$KILN" trace resnet18 -o "$WORK/resnet18.kiln.safetensors" || exit 1
"$KILN" trace mobilenet_v2 -o "$WORK/mobilenet_v2.kiln.safetensors" || exit 1
REPO=$WORK/models
profile=(--min-shapes input:3x64x64 --opt-shapes input:3x96x96 --max-shapes input:3x160x160)
"$KILN" triton-repo "$WORK/resnet18.kiln.safetensors" -o "$REPO" --name resnet18_dyn --count 2 --precision fp32 \
  --max-batch-size 2 "${profile[@]}" --backend-directory "$WORK/backends" || exit 1
"$KILN" triton-repo "$WORK/resnet18.kiln.safetensors" -o "$REPO" --name resnet18_finite --precision fp32 \
  --max-batch-size 2 "${profile[@]}" --refuse-non-finite --backend-directory "$WORK/backends" || exit 1
"$KILN" triton-repo "$WORK/mobilenet_v2.kiln.safetensors" -o "$REPO" --name mobilenet_v2 --precision fp32 \
  --max-batch-size 4 --backend-directory "$WORK/backends" || exit 1
grep -h "count\|kind\|max_batch_size" "$REPO"/*/config.pbtxt | sort | uniq -c

say "references: \`kiln compare --fp32\` on GPU 0 for each input of the pool"
ref() { # model graph NxCxHxW seed
  "$KILN" compare "$2" --fp32 --shapes "input:$3" --seed "$4" --timing-cache "$WORK/timing.json" \
    --save-outputs "$WORK/refs/$1__$3_s$4.safetensors" -q >/dev/null || { echo "kiln compare $1 $3 failed"; exit 1; }
}
for s in 1x3x64x64 2x3x64x64 1x3x96x96 2x3x96x64 1x3x160x160 2x3x128x160; do
  ref resnet18_dyn "$WORK/resnet18.kiln.safetensors" "$s" 7
done
for f in "$WORK"/refs/resnet18_dyn__*; do cp "$f" "${f/resnet18_dyn__/resnet18_finite__}"; done
for s in 1x3x224x224 2x3x224x224 4x3x224x224; do
  ref mobilenet_v2 "$WORK/mobilenet_v2.kiln.safetensors" "$s" 11
done
ls "$WORK/refs" | wc -l

read -r HTTP_PORT GRPC_PORT METRICS_PORT < <(python3 "$ROOT/tools/triton_checks.py" --free-ports 3)
say "the storm, the restart and the soak (tools/triton_gpu_storm.py)"
# shellcheck disable=SC2086
timeout 900 python3 "$ROOT/tools/triton_gpu_storm.py" --server "$WORK/server/pytriton/tritonserver/bin/tritonserver" \
  --repo "$REPO" --backends "$WORK/backends" --refs "$WORK/refs" --out "$OUT/gpu-storm" \
  --http "127.0.0.1:$HTTP_PORT" --grpc "127.0.0.1:$GRPC_PORT" --metrics "127.0.0.1:$METRICS_PORT" ${STORM_ARGS:-}
rc=$?
say "done (exit $rc)"
rm -rf "$WORK"
exit "$rc"
