#!/usr/bin/env bash
# Triton serving Kiln engines on GPUs, beside `kiln bench` on the same engine (issue 30, item 6).
# Run on the GPU machine from the repository root, with the binaries built beforehand:
#
#   cargo build --release --bin kiln && cargo build --release -p kiln-triton --lib
#   tools/triton-bench.sh --fetch-wheels shared/wheels      # here (the device has no registry)
#   tools/triton-bench.sh one|two|yolo|all                   # there; results under $OUT
#
# Each part takes about 3 to 6 minutes (engine builds, perf_analyzer's windows): give the device one
# call per part (`one` and `yolo` on an H100/H200, `two` on a two-GPU machine).
#
#   one   ResNet-50 FP16 engine (batch 1..128): `kiln bench` at batch 1..128, then Triton with
#         KIND_GPU on GPU 0 (2 instances, dynamic batching), perf_analyzer (gRPC, batch-1 requests) at
#         concurrency 1, 8, 32, 128, plus 32 with inputs and outputs in CUDA shared memory (GPU-resident)
#         and in system shared memory; 16 answers saved for `two`.
#   two   the same engine on GPUs 0 and 1 (one instance group, gpus [0, 1]), perf_analyzer at 32, 128
#         and 256, throughput against one GPU's; every answer of GPU 1 alone, and of both GPUs under
#         load, compared bit for bit with GPU 0's (with `one`'s results when it ran in the same $OUT on
#         this machine, else its own one-GPU baseline at 128 first).
#   yolo  YOLOv8n FP16 on decoded 720x1280 frames (u8), letterbox and NMS inside the engine, built by
#         the backend on first load from a graph file (and cached), perf_analyzer at 1, 8, 32, and
#         `kiln bench` on the engine the backend built.
#
# Environment: KILN, BACKEND (default: target/release/{kiln,libtriton_kiln.so}); repositories come from `kiln triton-repo`;
# KILN_LD (where CUDA 13 and cuDNN 9 are), OUT (default ./triton-bench-out), KILN_TRITON_WHEELS (default shared/wheels): the
# nvidia-pytriton 0.7.0 wheel (the server) and tritonclient 2.51.0's manylinux1 wheel (perf_analyzer);
# without them the registry is asked. INSTANCES (default 2 per GPU), DELAY_US (queue delay, default 200).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/triton-bench-out}
WHEELS=${KILN_TRITON_WHEELS:-$ROOT/shared/wheels}
INSTANCES=${INSTANCES:-2}
DELAY_US=${DELAY_US:-200}
KILN=${KILN:-$ROOT/target/release/kiln}
BACKEND=${BACKEND:-$ROOT/target/release/libtriton_kiln.so}
# Kiln (in the server and in `kiln bench`) loads CUDA 13's cuBLASLt and NVRTC and cuDNN 9 at run time;
# the server's own CUDA 12 runtime is bundled under other names, so both fit one path.
KILN_LD=${KILN_LD:-/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu:/usr/lib}
CLIENT="python3 $ROOT/tools/triton_bench_client.py"

fetch_wheels() {
  mkdir -p "$1"
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 -d "$1" nvidia-pytriton==0.7.0
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux1_x86_64 -d "$1" tritonclient==2.51.0
  ls -la "$1"
}
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  fetch_wheels "${2:?give a folder}"
  exit 0
fi
WHAT=${1:-all}

mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/kiln-triton-bench.XXXXXX)
SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap 'stop_server; rm -rf "$WORK"' EXIT
trap 'exit 130' INT TERM
say() { echo "[triton-bench] $*" | tee -a "$OUT/log.txt"; }

for f in "$KILN" "$BACKEND"; do
  [[ -x "$f" || -f "$f" ]] || { echo "missing $f: build it first (see the top of this script)"; exit 1; }
done

# The server and perf_analyzer, unzipped from their wheels.
PERF=$WORK/client/tritonclient-2.51.0.data/data/bin/perf_analyzer
if [[ -n "${TRITON_SLIM:-}" ]]; then
  # A slim copy (when the wheels exceed what can be carried): the server binary and its libraries
  # as a tar.xz, and perf_analyzer as an xz file.
  mkdir -p "$WORK/server" "$(dirname "$PERF")"
  tar -xJf "$TRITON_SLIM" -C "$WORK/server"
  xz -dc "${PERF_XZ:?PERF_XZ names perf_analyzer.xz}" >"$PERF"
else
  if ! ls "$WHEELS"/nvidia_pytriton-0.7.0-*.whl >/dev/null 2>&1 || ! ls "$WHEELS"/tritonclient-2.51.0-*manylinux1*.whl >/dev/null 2>&1; then
    say "no wheels in $WHEELS: downloading them"
    fetch_wheels "$WORK/wheels"
    WHEELS=$WORK/wheels
  fi
  python3 -m zipfile -e "$WHEELS"/nvidia_pytriton-0.7.0-*.whl "$WORK/server"
  python3 -m zipfile -e "$WHEELS"/tritonclient-2.51.0-*manylinux1*.whl "$WORK/client"
fi
TRITONSERVER=$WORK/server/pytriton/tritonserver/bin/tritonserver
chmod +x "$TRITONSERVER" "$PERF"
LIBS=$WORK/server/nvidia_pytriton.libs
# perf_analyzer wants libb64 and CUDA 12's runtime by their plain names; the server's wheel has both.
mkdir -p "$WORK/palibs"
ln -sf "$LIBS"/libb64-*.so.0d "$WORK/palibs/libb64.so.0d"
ln -sf "$LIBS"/libcudart-*.so.12* "$WORK/palibs/libcudart.so.12"
export LD_LIBRARY_PATH="$LIBS:$WORK/palibs:$KILN_LD"
mkdir -p "$WORK/backends/kiln"
cp "$BACKEND" "$WORK/backends/kiln/"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | tee "$OUT/gpus.csv"

HTTP=18000 GRPC=18001 METRICS=18002
start_server() { # repo log
  "$TRITONSERVER" --model-repository="$1" --backend-directory="$WORK/backends" \
    --http-address=127.0.0.1 --http-port=$HTTP --grpc-address=127.0.0.1 --grpc-port=$GRPC \
    --metrics-address=127.0.0.1 --metrics-port=$METRICS >"$2" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 1200); do # engines may be built on first load
    kill -0 "$SERVER_PID" 2>/dev/null || { say "tritonserver exited; see $2"; tail -n 30 "$2"; exit 1; }
    [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP/v2/health/ready" || true) == 200 ]] && return 0
    sleep 0.5
  done
  say "tritonserver not ready after 600 s; see $2"
  exit 1
}
perf() { # model concurrency csv [extra perf_analyzer flags...]
  local model=$1 c=$2 csv=$3
  shift 3
  say "perf_analyzer $model concurrency $c $*"
  # Three 4 s windows within 20% of each other (p99 latency), at most 8 tries; no CSV when unstable.
  timeout 240 "$PERF" -m "$model" -u "127.0.0.1:$GRPC" -i grpc -b 1 --concurrency-range "$c:$c" \
    --measurement-interval 4000 --max-trials 8 --stability-percentage 20 --percentile 99 -f "$csv" "$@" 2>&1 |
    tail -n 12 | tee -a "$OUT/log.txt" || true
  [[ -f "$csv" ]] || say "no stable measurement for $model at concurrency $c $*"
}
metrics() { curl -s "http://127.0.0.1:$METRICS/metrics" >"$1"; }

ENGINE=$OUT/resnet50_fp16_b128.kiln
one_gpu() {
  build_engine
  say "kiln bench on the same engine"
  "$KILN" bench --loadEngine "$ENGINE" --batch 1,8,32,64,128 --json "$OUT/kiln_bench_resnet50.json" 2>&1 | tee -a "$OUT/log.txt"
  "$KILN" triton-repo "$ENGINE" -o "$WORK/repo1" --name resnet50 --count "$INSTANCES" --gpus 0 --max-queue-delay-us "$DELAY_US" \
    --backend-directory "$WORK/backends"
  cp "$WORK/repo1/resnet50/config.pbtxt" "$OUT/one_gpu_config.pbtxt"
  start_server "$WORK/repo1" "$OUT/server_one_gpu.log"
  mkdir -p "$OUT/one_gpu"
  for c in 1 8 32 128; do perf resnet50 $c "$OUT/one_gpu/c$(printf %03d $c).csv"; done
  # Inputs already on the GPU (CUDA shared memory): what the server and the backend cost, without
  # 600 KB of FP32 pixels a request through gRPC (which caps the runs above at a few GB/s).
  for c in 32 128 256; do
    perf resnet50 $c "$OUT/one_gpu/c$(printf %03d $c)_cuda_shm.csv" --shared-memory=cuda --output-shared-memory-size=4000
  done
  perf resnet50 32 "$OUT/one_gpu/c032_system_shm.csv" --shared-memory=system --output-shared-memory-size=4000
  $CLIENT outputs --url 127.0.0.1:$HTTP --model resnet50 --shape 1x3x224x224 --count 16 --out "$OUT/answers_gpu0.json"
  metrics "$OUT/metrics_one_gpu.txt"
  stop_server
  $CLIENT summary --dir "$OUT/one_gpu" --kiln-bench "$OUT/kiln_bench_resnet50.json" \
    --title "ResNet-50 FP16, Triton on one GPU ($INSTANCES instances, dynamic batching, queue delay ${DELAY_US} us)" --append "$OUT/summary.md"
}

build_engine() {
  if [[ ! -f "$ENGINE" ]]; then
    say "kiln build resnet50 --fp16, batch 1..128"
    "$KILN" build resnet50 --fp16 --min-batch 1 --opt-batch 128 --max-batch 128 -o "$ENGINE" 2>&1 | tail -n 3 | tee -a "$OUT/log.txt"
  fi
}

two_gpus() {
  build_engine
  if [[ ! -f "$OUT/one_gpu/c128.csv" || ! -f "$OUT/one_gpu/c256_cuda_shm.csv" || ! -f "$OUT/answers_gpu0.json" ]]; then
    # The one-GPU baseline on this machine, when `one` did not run here.
    "$KILN" triton-repo "$ENGINE" -o "$WORK/repo1" --name resnet50 --count "$INSTANCES" --gpus 0 --max-queue-delay-us "$DELAY_US"
    start_server "$WORK/repo1" "$OUT/server_one_gpu_baseline.log"
    mkdir -p "$OUT/one_gpu"
    perf resnet50 128 "$OUT/one_gpu/c128.csv"
    perf resnet50 256 "$OUT/one_gpu/c256_cuda_shm.csv" --shared-memory=cuda --output-shared-memory-size=4000
    $CLIENT outputs --url 127.0.0.1:$HTTP --model resnet50 --shape 1x3x224x224 --count 16 --out "$OUT/answers_gpu0.json"
    stop_server
  fi
  "$KILN" triton-repo "$ENGINE" -o "$WORK/repo2" --name resnet50 --count "$INSTANCES" --gpus 0,1 --max-queue-delay-us "$DELAY_US"
  "$KILN" triton-repo "$ENGINE" -o "$WORK/repo2" --name resnet50_gpu1 --count 1 --gpus 1
  cp "$WORK/repo2/resnet50/config.pbtxt" "$OUT/two_gpu_config.pbtxt"
  start_server "$WORK/repo2" "$OUT/server_two_gpus.log"
  mkdir -p "$OUT/two_gpus"
  for c in 32 128 256; do perf resnet50 $c "$OUT/two_gpus/c$(printf %03d $c).csv"; done
  for c in 256 512; do
    perf resnet50 $c "$OUT/two_gpus/c$(printf %03d $c)_cuda_shm.csv" --shared-memory=cuda --output-shared-memory-size=4000
  done
  $CLIENT outputs --url 127.0.0.1:$HTTP --model resnet50_gpu1 --shape 1x3x224x224 --count 16 --out "$OUT/answers_gpu1.json"
  $CLIENT outputs --url 127.0.0.1:$HTTP --model resnet50 --shape 1x3x224x224 --count 16 --concurrency 16 --out "$OUT/answers_two_gpus.json"
  metrics "$OUT/metrics_two_gpus.txt"
  stop_server
  {
    echo "GPU 1 alone against GPU 0 (one request at a time):"
    $CLIENT same "$OUT/answers_gpu0.json" "$OUT/answers_gpu1.json" || true
    echo "Both GPUs under 16 concurrent requests (batches formed by the dynamic batcher) against GPU 0 alone:"
    $CLIENT same "$OUT/answers_gpu0.json" "$OUT/answers_two_gpus.json" || true
  } | tee "$OUT/two_gpus_outputs.txt"
  $CLIENT summary --dir "$OUT/two_gpus" --kiln-bench "$OUT/kiln_bench_resnet50.json" \
    --title "ResNet-50 FP16, Triton on two GPUs (instance group gpus [0, 1], $INSTANCES instances each)" --append "$OUT/summary.md"
  python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.md"
import csv, sys, os
out = sys.argv[1]
def tput(path):
    if not os.path.exists(path):
        return float("nan")
    rows = list(csv.DictReader(open(path)))
    return float(rows[-1]["Inferences/Second"]) if rows else float("nan")
one = tput(os.path.join(out, "one_gpu", "c128.csv"))
for c in (128, 256):
    two = tput(os.path.join(out, "two_gpus", f"c{c:03d}.csv"))
    print(f"- gRPC payloads, two GPUs at concurrency {c}: {two:.0f} images/s = {two / one:.2f}x one GPU's {one:.0f} at 128")
one_shm = tput(os.path.join(out, "one_gpu", "c256_cuda_shm.csv"))
for c in (256, 512):
    two = tput(os.path.join(out, "two_gpus", f"c{c:03d}_cuda_shm.csv"))
    print(f"- inputs in CUDA shared memory, two GPUs at concurrency {c}: {two:.0f} images/s = {two / one_shm:.2f}x one GPU's {one_shm:.0f} at 256 (target >= 1.8x)")
print()
PY
  cat "$OUT/two_gpus_outputs.txt" | sed 's/^/    /' >>"$OUT/summary.md"
}

yolo() {
  "$KILN" triton-repo yolov8n --letterbox 720x1280 -o "$WORK/repo3" --name yolov8n --precision fp16 --max-batch-size 16 \
    --count "$INSTANCES" --gpus 0 --max-queue-delay-us "$DELAY_US"
  cp "$WORK/repo3/yolov8n/config.pbtxt" "$OUT/yolo_config.pbtxt"
  local t0=$SECONDS
  start_server "$WORK/repo3" "$OUT/server_yolo.log"
  say "yolov8n loaded (engine built by the backend) in $((SECONDS - t0)) s"
  mkdir -p "$OUT/yolo"
  for c in 1 8 32; do perf yolov8n $c "$OUT/yolo/c$(printf %03d $c).csv"; done
  $CLIENT outputs --url 127.0.0.1:$HTTP --model yolov8n --input frame --shape 1x720x3840 --dtype UINT8 --count 2 --out "$OUT/answers_yolo.json"
  stop_server
  local cached
  cached=$(ls "$WORK"/repo3/yolov8n/1/model.sm*.kiln | head -n 1)
  say "kiln bench on the backend's cached engine $(basename "$cached")"
  "$KILN" bench --loadEngine "$cached" --batch 1,8,16 --json "$OUT/kiln_bench_yolo.json" 2>&1 | tee -a "$OUT/log.txt"
  $CLIENT summary --dir "$OUT/yolo" --kiln-bench "$OUT/kiln_bench_yolo.json" \
    --title "YOLOv8n FP16 on 720x1280 u8 frames (letterbox and NMS in the engine), Triton on one GPU" --append "$OUT/summary.md"
}

case "$WHAT" in
  one) one_gpu ;;
  two) two_gpus ;;
  yolo) yolo ;;
  all) one_gpu; two_gpus; yolo ;;
  *) echo "usage: $0 one|two|yolo|all  |  $0 --fetch-wheels DIR"; exit 2 ;;
esac
say "results in $OUT (summary.md)"
