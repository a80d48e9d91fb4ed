# syntax=docker/dockerfile:1.7
# Argosy operator: kopf and its HTTP client only; no torch (see docker/image_requirements.py).
#
# Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/argosy-project/argosy-operator:0.1.0 .
#
# Base image pinned by digest; docs/deploy.md ("Base images") records the tag it came from and
# how to refresh it. Override with --build-arg PYTHON_IMAGE=... to rebuild on a patched base.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Third-party dependencies first, from pyproject's `operator` extra, so this layer is cached
# across source edits. The project itself goes in with --no-deps: its core dependencies pin
# torch, which the operator never imports.
COPY pyproject.toml README.md ./
COPY docker/image_requirements.py docker/
RUN python docker/image_requirements.py operator > /tmp/requirements.txt \
 && pip install --requirement /tmp/requirements.txt
COPY runtime runtime
COPY kernels kernels
COPY operator operator
RUN pip install --no-deps . \
 && python -c "import importlib.util as u, argosy_operator; assert u.find_spec('torch') is None, 'torch in operator image'"

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="argosy-operator" \
      org.opencontainers.image.description="Kubernetes operator for LLMDeployment resources (argosy.dev/v1alpha1)" \
      org.opencontainers.image.source="https://github.com/argosy-project/argosy" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="argosy-project"
# A named user with a home directory (some libraries look the user up); the numeric USER lets
# the kubelet check runAsNonRoot.
RUN groupadd --system --gid 1000 argosy \
 && useradd --system --uid 1000 --gid argosy --home-dir /home/argosy --create-home argosy
COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/argosy
USER 1000:1000
WORKDIR /home/argosy
# kopf's liveness endpoint (GET /healthz), probed by manifests/operator. --standalone: one
# operator at a time, without kopf's peering resources; the same command as manifests/operator.
EXPOSE 8080
CMD ["kopf", "run", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz", "-m", "argosy_operator.handlers"]
