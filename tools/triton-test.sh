#!/usr/bin/env bash
# Serves Kiln models from a real Triton Inference Server through the Kiln backend, on the CPU (no
# GPU needed), and checks it with tritonclient (tools/triton_client_test.py). Called by .ci/run.
#
#   1. installs tritonclient[all] and unzips the server from the nvidia-pytriton 0.7.0 wheel
#      (Triton 2.51.0; pytriton itself is not imported);
#   2. builds libtriton_kiln.so and the kiln binary, traces ResNet-18 into a graph file;
#   3. writes a model repository (KIND_CPU): resnet18, resnet18_dyn (an H x W profile),
#      resnet18_finite (the same, refusing NaN and infinity) and broken (config dims that disagree
#      with the graph, loaded by the client test: must fail);
#   4. starts tritonserver on 127.0.0.1 (free ports) with --backend-directory, runs the client
#      test, then a bounded storm (tools/triton_storm.py: 320 requests from 16 clients, about 30%
#      malformed, every valid answer checked, at most 300 s), and always stops the server (trap).
# Prints PASS/FAIL per check and a summary; exits non-zero on any failure.
#
# Environment: KILN_TRITON_CACHE (default ~/.cache/kiln-triton) keeps the wheel and the unzipped
# server between runs; KILN_TRITON_KEEP=1 keeps the work folder (repository, server log).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
T0=$SECONDS

CACHE=${KILN_TRITON_CACHE:-$HOME/.cache/kiln-triton}
WORK=$(mktemp -d /tmp/kiln-triton-test.XXXXXX)
SERVER_PID=""
LOG="$WORK/tritonserver.log"

stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.5
    done
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    echo "tritonserver stopped"
  fi
  SERVER_PID=""
}
cleanup() {
  local rc=$?
  stop_server
  if ((rc != 0)) && [[ -f "$LOG" ]]; then
    echo "---- last lines of the server log ($LOG) ----"
    tail -n 40 "$LOG" || true
  fi
  if [[ "${KILN_TRITON_KEEP:-0}" != 1 ]]; then rm -rf "$WORK"; else echo "kept $WORK"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

say() { echo "[triton-test $((SECONDS - T0)) s] $*"; }

# 1. The client and the server.
say "pip install tritonclient[all] numpy; nvidia-pytriton 0.7.0 (the server, unzipped)"
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "tritonclient[all]" numpy
SERVER_DIR="$CACHE/nvidia-pytriton-0.7.0"
if [[ ! -x "$SERVER_DIR/pytriton/tritonserver/bin/tritonserver" ]]; then
  mkdir -p "$CACHE/wheels"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_35_x86_64 \
    -d "$CACHE/wheels" nvidia-pytriton==0.7.0
  rm -rf "$SERVER_DIR.tmp"
  python3 -m zipfile -e "$CACHE"/wheels/nvidia_pytriton-0.7.0-*.whl "$SERVER_DIR.tmp"
  chmod +x "$SERVER_DIR.tmp/pytriton/tritonserver/bin/tritonserver"
  mv "$SERVER_DIR.tmp" "$SERVER_DIR"
fi
TRITONSERVER="$SERVER_DIR/pytriton/tritonserver/bin/tritonserver"
export LD_LIBRARY_PATH="$SERVER_DIR/nvidia_pytriton.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# 2. The backend, the kiln binary and the model.
say "cargo build --release: libtriton_kiln.so, kiln, the repository writer"
cargo build --release --quiet -p kiln-triton --lib
cargo build --release --quiet --bin kiln
KILN="$ROOT/target/release/kiln"
mkdir -p "$WORK/backends/kiln"
cp "$ROOT/target/release/libtriton_kiln.so" "$WORK/backends/kiln/"
GRAPH="$WORK/resnet18.kiln.safetensors"
"$KILN" trace resnet18 -o "$GRAPH"

# 3. The repository, written by `kiln triton-repo`.
REPO="$WORK/models"
triton_repo() {
  "$KILN" triton-repo "$@"
}
triton_repo "$GRAPH" -o "$REPO" --name resnet18 --cpu --max-batch-size 8 --max-queue-delay-us 20000 \
  --backend-directory "$WORK/backends"
triton_repo "$GRAPH" -o "$REPO" --name resnet18_dyn --cpu --max-batch-size 2 --backend-directory "$WORK/backends" \
  --min-shapes input:3x64x64 --opt-shapes input:3x96x96 --max-shapes input:3x160x160
triton_repo "$GRAPH" -o "$REPO" --name resnet18_finite --cpu --max-batch-size 2 --backend-directory "$WORK/backends" \
  --min-shapes input:3x64x64 --opt-shapes input:3x96x96 --max-shapes input:3x160x160 --refuse-non-finite
triton_repo "$GRAPH" -o "$REPO" --name broken --cpu --max-batch-size 8 --backend-directory "$WORK/backends"
sed -i 's/dims: \[ 3, 224, 224 \]/dims: [ 3, 200, 200 ]/' "$REPO/broken/config.pbtxt"
echo "---- $REPO/resnet18/config.pbtxt ----"
cat "$REPO/resnet18/config.pbtxt"
echo "---- $REPO/README.md ----"
cat "$REPO/README.md"

# 4. The server, on 127.0.0.1 only, with three free ports.
read -r HTTP_PORT GRPC_PORT METRICS_PORT < <(python3 "$ROOT/tools/triton_checks.py" --free-ports 3)
say "starting tritonserver 2.51 on 127.0.0.1 (HTTP $HTTP_PORT, gRPC $GRPC_PORT, metrics $METRICS_PORT)"
"$TRITONSERVER" --model-repository="$REPO" --backend-directory="$WORK/backends" \
  --model-control-mode=explicit --load-model=resnet18 --load-model=resnet18_dyn --load-model=resnet18_finite \
  --strict-readiness=false --exit-on-error=false \
  --http-address=127.0.0.1 --http-port="$HTTP_PORT" \
  --grpc-address=127.0.0.1 --grpc-port="$GRPC_PORT" \
  --metrics-address=127.0.0.1 --metrics-port="$METRICS_PORT" \
  >"$LOG" 2>&1 &
SERVER_PID=$!
ready=0
for _ in $(seq 1 240); do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "FAIL  tritonserver exited while starting"
    exit 1
  fi
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP_PORT/v2/health/ready" || true)
  for m in resnet18 resnet18_dyn resnet18_finite; do
    [[ "$code" == 200 ]] && code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$HTTP_PORT/v2/models/$m/ready" || true)
  done
  if [[ "$code" == 200 ]]; then ready=1 && break; fi
  sleep 0.5
done
if ((ready != 1)); then
  echo "FAIL  tritonserver was not ready within 120 s"
  exit 1
fi
say "server ready; the backend's lines from its log:"
grep -i "kiln" "$LOG" | sed 's/^/    /' | head -n 20 || true

set +e
timeout 600 python3 "$ROOT/tools/triton_client_test.py" --http "127.0.0.1:$HTTP_PORT" --grpc "127.0.0.1:$GRPC_PORT" \
  --metrics "127.0.0.1:$METRICS_PORT" --kiln "$KILN" --graph "$GRAPH" --work "$WORK"
rc=$?
say "the storm (tools/triton_storm.py)"
timeout 420 python3 "$ROOT/tools/triton_storm.py" --http "127.0.0.1:$HTTP_PORT" --grpc "127.0.0.1:$GRPC_PORT" \
  --metrics "127.0.0.1:$METRICS_PORT" --requests 320 --clients 16 --seconds 300 || rc=1
set -e
if ! kill -0 "$SERVER_PID" 2>/dev/null; then
  echo "FAIL  tritonserver is no longer running after the tests"
  rc=1
fi
stop_server
if grep -q "panic" "$LOG"; then
  echo "FAIL  the server log mentions a panic:"
  grep -n "panic" "$LOG" | head -n 5
  rc=1
fi
say "done"
if ((rc == 0)); then echo "triton-test: PASS"; else echo "triton-test: FAIL"; fi
exit "$rc"
