#!/usr/bin/env bash
# Triton serving Kiln engines on GPUs, beside `kiln bench` on the same engine (issue 30, item 6).
# Run on the GPU machine from the repository root, with the binaries built beforehand:
#
#   cargo build --release --bin kiln && cargo build --release -p kiln-triton --lib
#   tools/triton-bench.sh --fetch-wheels shared/wheels      # here (the device has no registry)
#   tools/triton-bench.sh build|one|two|yolo|all             # there; results under $OUT
#
# Each part takes about 3 to 7 minutes (engine builds, perf_analyzer's windows): give the device one
# call per part (`one` and `yolo` on an H100/H200, `two` on a two-GPU machine). With ENGINE_DIR on a
# folder the machine keeps between calls (e.g. target/triton-bench), `build` makes the engine and its
# `kiln bench` once, and `one` and `two` reuse both.
#
#   build ResNet-50 FP16 engine (batch 1..$MAX_BATCH, opt $MAX_BATCH) and `kiln bench` on it, both kept in
#         $ENGINE_DIR (`one` and `two` do this first when they find neither).
#   one   ResNet-50 FP16 engine (batch 1..$MAX_BATCH, opt $MAX_BATCH): `kiln bench` at batch 1..$MAX_BATCH (CUDA
#         graphs, as the backend runs it), then Triton with KIND_GPU on GPU 0 ($INSTANCES instances, dynamic
#         batching) and perf_analyzer: gRPC payloads with batch-1 requests at concurrency 1, 8, 32, 128
#         (600 KB of FP32 pixels a request through gRPC); inputs and outputs in CUDA shared memory
#         (GPU-resident) with batch-1 requests at 32 and 256, and with batch-$REQ_BATCH requests at 32 and 64
#         (512 and 1024 images in flight: what lets the batcher form the engine's best batch). Each run
#         also reports the batch Triton formed on average (its statistics); 16 answers saved for `two`.
#   two   the same engine on GPUs 0 and 1 (one instance group, gpus [0, 1]): gRPC at 128 and 256, CUDA
#         shared memory with batch-1 requests at 256 and 512 and batch-$REQ_BATCH requests at 64 and 128,
#         throughput against one GPU's (its own one-GPU baseline first, on this machine, unless `one`
#         ran in the same $OUT); every answer of GPU 1 alone, and of both GPUs under load, compared
#         bit for bit with GPU 0's. perf_analyzer puts its CUDA shared memory on GPU 0: GPU 1's
#         instances read the inputs and write the outputs there by peer copies (the server log names
#         the GPUs each instance reaches directly).
#   yolo  YOLOv8n FP16 on decoded 720x1280 frames (u8), letterbox and NMS inside the engine, built by
#         the backend on first load from a graph file (and cached), perf_analyzer at 1, 8, 32, and
#         `kiln bench` on the engine the backend built.
#
# Environment: KILN, BACKEND (default: target/release/{kiln,libtriton_kiln.so}); repositories come from `kiln triton-repo`;
# KILN_LD (where CUDA 13 and cuDNN 9 are), OUT (default ./triton-bench-out), KILN_TRITON_WHEELS (default shared/wheels): the
# nvidia-pytriton 0.7.0 wheel (the server) and tritonclient 2.51.0's manylinux1 wheel (perf_analyzer);
# without them the registry is asked. INSTANCES (default 3 per GPU: see docs/SERVING.md), DELAY_US (queue delay, default 200),
# MAX_BATCH (the engine's max and opt batch, default 256), REQ_BATCH (images a batched request, default 16),
# ENGINE_DIR (where the engine is built and reused, default $OUT; a folder kept between calls saves the build),
# QUICK=1 (only the CUDA-shared-memory runs that bound the server: batch-1 at 256, batch-$REQ_BATCH at 64 on
# one GPU and 128 on two; `kiln bench` at the max batch alone).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/triton-bench-out}
WHEELS=${KILN_TRITON_WHEELS:-$ROOT/shared/wheels}
INSTANCES=${INSTANCES:-3}
DELAY_US=${DELAY_US:-200}
MAX_BATCH=${MAX_BATCH:-256}
REQ_BATCH=${REQ_BATCH:-16}
ENGINE_DIR=${ENGINE_DIR:-$OUT}
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
perf() { # model request-batch concurrency csv [extra perf_analyzer flags...]
  local model=$1 b=$2 c=$3 csv=$4
  shift 4
  say "perf_analyzer $model batch-$b requests, concurrency $c $*"
  curl -s "http://127.0.0.1:$HTTP/v2/models/$model/stats" >"$WORK/stats_before.json" || true
  # Three 4 s windows within 20% of each other (p99 latency), at most 8 tries; no CSV when unstable.
  timeout 240 "$PERF" -m "$model" -u "127.0.0.1:$GRPC" -i grpc -b "$b" --concurrency-range "$c:$c" \
    --measurement-interval 4000 --max-trials 8 --stability-percentage 20 --percentile 99 -f "$csv" "$@" 2>&1 |
    tail -n 12 | tee -a "$OUT/log.txt" || true
  curl -s "http://127.0.0.1:$HTTP/v2/models/$model/stats" >"$WORK/stats_after.json" || true
  # The batches Triton formed over the whole run (warm-up included), beside the CSV.
  $CLIENT batches "$WORK/stats_before.json" "$WORK/stats_after.json" --out "${csv%.csv}.batches.json" | tee -a "$OUT/log.txt" || true
  [[ -f "$csv" ]] || say "no stable measurement for $model at concurrency $c $*"
}
shm() { # request-batch: perf_analyzer's flags for inputs and outputs in CUDA shared memory (ResNet-50's 1000 logits)
  echo "--shared-memory=cuda --output-shared-memory-size=$((4000 * $1))"
}
metrics() { curl -s "http://127.0.0.1:$METRICS/metrics" >"$1"; }
# perf_analyzer over resnet50 into DIR, one run per concurrency of each space-separated list (an
# empty list runs nothing): gRPC payloads with batch-1 requests; CUDA shared memory with batch-1
# requests; CUDA shared memory with batch-$REQ_BATCH requests. Each CSV is named
# c<concurrency>_b<request batch>_<grpc|cuda_shm>.csv.
sweep() { # dir grpc-concurrencies shm-batch-1-concurrencies shm-batched-concurrencies
  local dir=$1 c
  mkdir -p "$dir"
  for c in $2; do perf resnet50 1 "$c" "$dir/c$(printf %03d "$c")_b1_grpc.csv"; done
  # shellcheck disable=SC2046
  for c in $3; do perf resnet50 1 "$c" "$dir/c$(printf %03d "$c")_b1_cuda_shm.csv" $(shm 1); done
  # shellcheck disable=SC2046
  for c in $4; do perf resnet50 "$REQ_BATCH" "$c" "$dir/c$(printf %03d "$c")_b${REQ_BATCH}_cuda_shm.csv" $(shm "$REQ_BATCH"); done
}

mkdir -p "$ENGINE_DIR"
ENGINE=$ENGINE_DIR/resnet50_fp16_b$MAX_BATCH.kiln
BENCH_BATCHES=$([[ ${QUICK:-0} == 1 ]] && echo "$MAX_BATCH" || python3 -c "import sys; m=int(sys.argv[1]); print(','.join(str(b) for b in [1,8,16,32,64,128,256,512] if b < m) + f',{m}')" "$MAX_BATCH")
# `kiln bench` on the engine, once per engine: kept beside it in $ENGINE_DIR and copied to $OUT.
kiln_bench() {
  local json=$ENGINE_DIR/kiln_bench_resnet50_b$MAX_BATCH.json
  if [[ ! -f "$json" || "$ENGINE" -nt "$json" ]]; then
    say "kiln bench on the same engine, batch $BENCH_BATCHES (CUDA graphs, as the backend runs it)"
    "$KILN" bench --loadEngine "$ENGINE" --batch "$BENCH_BATCHES" --cuda-graphs-only --json "$json" 2>&1 | tee -a "$OUT/log.txt"
  else
    say "kiln bench of this engine from $json"
  fi
  [[ "$json" -ef "$OUT/kiln_bench_resnet50.json" ]] || cp "$json" "$OUT/kiln_bench_resnet50.json"
}

one_gpu() {
  build_engine
  kiln_bench
  "$KILN" triton-repo "$ENGINE" -o "$WORK/repo1" --name resnet50 --count "$INSTANCES" --gpus 0 --max-queue-delay-us "$DELAY_US" \
    --backend-directory "$WORK/backends"
  cp "$WORK/repo1/resnet50/config.pbtxt" "$OUT/one_gpu_config.pbtxt"
  start_server "$WORK/repo1" "$OUT/server_one_gpu.log"
  # QUICK=1: only the two runs that bound the server's cost (CUDA shared memory, batch-1 requests at
  # 256 and batch-$REQ_BATCH requests at 64), for a short device call. CUDA shared memory keeps the
  # inputs on the GPU: what the server and the backend cost, without 600 KB of FP32 pixels a request
  # through gRPC (which caps the gRPC runs at a few GB/s). Batch-1 requests at concurrency 32 can
  # never form a batch over 32; batched requests can form the engine's best.
  if [[ ${QUICK:-0} == 1 ]]; then sweep "$OUT/one_gpu" "" "256" "64"; else sweep "$OUT/one_gpu" "1 8 32 128" "32 256" "32 64"; fi
  $CLIENT outputs --url 127.0.0.1:$HTTP --model resnet50 --shape 1x3x224x224 --count 16 --out "$OUT/answers_gpu0.json"
  metrics "$OUT/metrics_one_gpu.txt"
  stop_server
  $CLIENT summary --dir "$OUT/one_gpu" --kiln-bench "$OUT/kiln_bench_resnet50.json" \
    --title "ResNet-50 FP16, Triton on one GPU ($INSTANCES instances, dynamic batching, queue delay ${DELAY_US} us)" --append "$OUT/summary.md"
}

build_engine() {
  if [[ ! -f "$ENGINE" ]]; then
    say "kiln build resnet50 --fp16, batch 1..$MAX_BATCH (opt $MAX_BATCH)"
    "$KILN" build resnet50 --fp16 --min-batch 1 --opt-batch "$MAX_BATCH" --max-batch "$MAX_BATCH" -o "$ENGINE" 2>&1 | tail -n 3 | tee -a "$OUT/log.txt"
  fi
}

two_gpus() {
  build_engine
  kiln_bench
  local b1=$OUT/one_gpu/c128_b1_grpc.csv s1=$OUT/one_gpu/c256_b1_cuda_shm.csv sb=$OUT/one_gpu/c064_b${REQ_BATCH}_cuda_shm.csv
  if [[ ! -f "$b1" || ! -f "$s1" || ! -f "$sb" || ! -f "$OUT/answers_gpu0.json" ]]; then
    # The one-GPU baseline on this machine, when `one` did not run here.
    "$KILN" triton-repo "$ENGINE" -o "$WORK/repo1" --name resnet50 --count "$INSTANCES" --gpus 0 --max-queue-delay-us "$DELAY_US"
    start_server "$WORK/repo1" "$OUT/server_one_gpu_baseline.log"
    if [[ ${QUICK:-0} == 1 ]]; then sweep "$OUT/one_gpu" "" "" "64"; else sweep "$OUT/one_gpu" "128" "256" "64"; fi
    $CLIENT outputs --url 127.0.0.1:$HTTP --model resnet50 --shape 1x3x224x224 --count 16 --out "$OUT/answers_gpu0.json"
    stop_server
  fi
  "$KILN" triton-repo "$ENGINE" -o "$WORK/repo2" --name resnet50 --count "$INSTANCES" --gpus 0,1 --max-queue-delay-us "$DELAY_US"
  "$KILN" triton-repo "$ENGINE" -o "$WORK/repo2" --name resnet50_gpu1 --count 1 --gpus 1
  cp "$WORK/repo2/resnet50/config.pbtxt" "$OUT/two_gpu_config.pbtxt"
  start_server "$WORK/repo2" "$OUT/server_two_gpus.log"
  say "perf_analyzer's CUDA shared memory lives on GPU 0; GPU 1's instances copy from and to it by peer copies:"
  grep -h "peer access" "$OUT/server_two_gpus.log" | sed 's/^/    /' | tee -a "$OUT/log.txt" ||
    say "no instance reports peer access: GPU 1's copies from GPU 0 are staged by the driver (slow)"
  if [[ ${QUICK:-0} == 1 ]]; then sweep "$OUT/two_gpus" "" "" "128"; else sweep "$OUT/two_gpus" "128 256" "256 512" "64 128"; fi
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
  $CLIENT ratios --one "$OUT/one_gpu" --two "$OUT/two_gpus" --req-batch "$REQ_BATCH" | tee -a "$OUT/summary.md" || true
  sed 's/^/    /' "$OUT/two_gpus_outputs.txt" >>"$OUT/summary.md"
}

yolo() {
  "$KILN" triton-repo yolov8n --letterbox 720x1280 -o "$WORK/repo3" --name yolov8n --precision fp16 --max-batch-size 16 \
    --count "$INSTANCES" --gpus 0 --max-queue-delay-us "$DELAY_US"
  cp "$WORK/repo3/yolov8n/config.pbtxt" "$OUT/yolo_config.pbtxt"
  local t0=$SECONDS
  start_server "$WORK/repo3" "$OUT/server_yolo.log"
  say "yolov8n loaded (engine built by the backend) in $((SECONDS - t0)) s"
  mkdir -p "$OUT/yolo"
  for c in 1 8 32; do perf yolov8n 1 $c "$OUT/yolo/c$(printf %03d $c)_b1_grpc.csv"; done
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
  build) build_engine; kiln_bench ;;
  one) one_gpu ;;
  two) two_gpus ;;
  yolo) yolo ;;
  all) one_gpu; two_gpus; yolo ;;
  *) echo "usage: $0 build|one|two|yolo|all  |  $0 --fetch-wheels DIR"; exit 2 ;;
esac
say "results in $OUT (summary.md)"
