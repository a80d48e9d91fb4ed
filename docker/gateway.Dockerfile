# syntax=docker/dockerfile:1.7
# Argosy gateway: the OpenAI-compatible router in front of runtime replicas. No torch: it
# installs the `server` extra's HTTP stack and the project with --no-deps
# (see docker/image_requirements.py).
#
# Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/argosy-project/argosy-gateway:0.1.0 .
#
# Base image pinned by digest; docs/deploy.md ("Base images") records the tag it came from and
# how to refresh it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY docker/image_requirements.py docker/
RUN python docker/image_requirements.py gateway > /tmp/requirements.txt \
 && pip install --requirement /tmp/requirements.txt
COPY runtime runtime
COPY kernels kernels
COPY operator operator
RUN pip install --no-deps . \
 && argosy --help > /dev/null \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch in gateway image'"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="argosy-gateway" \
      org.opencontainers.image.description="Argosy gateway: KV-cache-aware OpenAI-compatible router across runtime replicas and models" \
      org.opencontainers.image.source="https://github.com/argosy-project/argosy" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="argosy-project"
RUN groupadd --system --gid 1000 argosy \
 && useradd --system --uid 1000 --gid argosy --home-dir /home/argosy --create-home argosy
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/argosy
USER 1000:1000
WORKDIR /home/argosy
EXPOSE 8080
# Mount the routing config (a ConfigMap) at /etc/argosy/gateway.yaml. --host 0.0.0.0: in a
# container the gateway must listen beyond loopback whatever the file says (its default is
# 127.0.0.1); --port / the file's port stay as configured (8080 by default).
CMD ["argosy", "gateway", "--config", "/etc/argosy/gateway.yaml", "--host", "0.0.0.0"]
