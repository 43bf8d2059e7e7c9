# Triton Inference Server with Kiln's backend and one Kiln model repository baked in: the image a
# KServe InferenceService (docs/SERVING.md) or a plain `docker run --gpus all` serves from.
#
#   docker build -f docker/triton-kiln.Dockerfile -t kiln-triton:resnet50 .
#   docker build -f docker/triton-kiln.Dockerfile --build-arg MODEL=yolov8n --build-arg MAX_BATCH=16 -t kiln-triton:yolov8n .
#   docker run --rm --gpus all -p 8000:8000 -p 8001:8001 -p 8002:8002 kiln-triton:resnet50
#
# NOT TESTED: no container runtime was available where this was written; the same steps were run by
# hand on a GPU-less machine (tools/triton-test.sh: the backend and a repository served by Triton
# 2.51 from the nvidia-pytriton wheel) and are scripted for a GPU in tools/triton-bench.sh.

# 1. Build the backend and the repository writer, and trace the model into a graph file.
FROM rust:1.85-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release -p kiln-triton --lib && cargo build --release --bin kiln
ARG MODEL=resnet50
ARG MAX_BATCH=64
ARG PRECISION=fp16
# A graph file on KIND_GPU: the backend builds the engine for the GPU it finds on first load and
# caches it beside the graph file (mount /models on a volume, or pre-build, to skip that per pod).
RUN target/release/kiln triton-repo ${MODEL} -o /models --name ${MODEL} --max-batch-size ${MAX_BATCH} \
      --precision ${PRECISION} --backend-directory /opt/tritonserver/backends

# 2. The server: NVIDIA's Triton image of the release the backend was tested with (2.51 = 24.10).
FROM nvcr.io/nvidia/tritonserver:24.10-py3
# Kiln loads CUDA 13's NVRTC and cuBLASLt and cuDNN 9 at run time (dynamic loading, through the
# driver API); the image's CUDA 12 stays for Triton itself. The host driver must support CUDA 13 (580+).
RUN python3 -m pip install --no-cache-dir nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.* nvidia-cudnn-cu13==9.* \
 && python3 - > /etc/ld.so.conf.d/kiln-cuda13.conf <<'PY'
import glob, os, nvidia
dirs = {os.path.dirname(p) for root in nvidia.__path__ for p in glob.glob(os.path.join(root, "**", "lib*.so*"), recursive=True)}
print("\n".join(sorted(dirs)))
PY
RUN ldconfig
COPY --from=build /src/target/release/libtriton_kiln.so /opt/tritonserver/backends/kiln/libtriton_kiln.so
COPY --from=build /models /models
EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository=/models", "--backend-directory=/opt/tritonserver/backends"]
