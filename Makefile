# The one entry point for people and CI. `make help` lists the targets.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: help
help: ## list the targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 18

# ---- set-up ---------------------------------------------------------------------------------------
.PHONY: install system-deps
install: $(STAMP) ## create .venv (when missing) and install the package with its test extras

$(STAMP): pyproject.toml setup.py operator/arl_tangram/sandbox/_zygote.c hack/system-deps.sh \
		operator/arl_tangram/sandbox/node-package-lock.json operator/arl_tangram/sandbox/gomodule/go.sum
	@bash hack/system-deps.sh
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	@$(BIN)/python -c 'import arl_tangram.sandbox._zygote' 2>/dev/null \
	  || echo "install: the C fork loop did not build (no C compiler?); the sandbox forks from Python, slower" >&2
	@# SandboxFusion's npm packages for Node programs (lodash, js-md5, ...), beside the venv's Python.
	$(BIN)/python -m arl_tangram.sandbox.nodepackages
	@# SandboxFusion's Go module's requirements (testify), in a module cache beside it.
	$(BIN)/python -m arl_tangram.sandbox.gopackages
	@# Fills what the sandbox agent would fill on its first start (Go's standard library, compiled).
	$(BIN)/python -m arl_tangram.sandbox.languages
	@touch $@

system-deps: ## install the Debian packages the sandbox and the test bed use (bubblewrap, ...)
	@bash hack/system-deps.sh

# ---- the main job ---------------------------------------------------------------------------------
.PHONY: demo
demo: install ## a HumanEval rollout really run: pod per trajectory vs tangram (charts in tangram-demo/)
	$(BIN)/tangram demo

# ---- tests ----------------------------------------------------------------------------------------
.PHONY: test test-unit test-e2e test-chaos
test: install ## run every test: unit, integration, and e2e on the local test bed (or KUBECONFIG)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

test-unit: install ## the fast tiers only (unit and integration)
	$(BIN)/python -m pytest -q tests/unit tests/integration

test-e2e: install ## the e2e tier only
	$(BIN)/python -m pytest -q tests/e2e

test-chaos: install ## the whole reliability suite (docs/reliability.md), its long faults and full load run included
	TANGRAM_CHAOS=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m reliability tests/reliability

# ---- generated files and static checks -------------------------------------------------------------
.PHONY: crds verify lint typecheck
crds: install ## regenerate crds/ and docs/crd-reference.md from the pydantic models in arl_tangram/api
	$(BIN)/tangram crds --out crds
	$(BIN)/tangram crds --docs docs/crd-reference.md

verify: install ## CRDs have no drift; ruff, mypy and the import layering are clean
	$(BIN)/tangram crds --out crds --check
	$(BIN)/tangram crds --docs docs/crd-reference.md --check
	$(BIN)/ruff check operator tests
	$(BIN)/ruff format --check operator tests
	$(BIN)/mypy
	$(BIN)/lint-imports

lint: install ## fix what ruff can and format the code
	$(BIN)/ruff check --fix operator tests
	$(BIN)/ruff format operator tests

# ---- benchmarks -------------------------------------------------------------------------------------
.PHONY: bench bench-exec bench-sim bench-sched
bench: bench-exec bench-sim bench-sched ## every benchmark, numbers side by side

bench-exec: install ## the sandbox agent: calls per second against a fresh process per call
	$(BIN)/tangram bench exec

bench-sim: install ## the simulator on the built-in workloads, every policy
	for w in ai-coding reward-gpu deepsearch mixed; do $(BIN)/tangram bench sim --workload $$w; done

bench-sched: install ## the scheduler's decision latency
	$(BIN)/tangram bench sched

# ---- GPUs -------------------------------------------------------------------------------------------
# Runs on a bare GPU machine (python3 with torch, nvidia-ml-py and numpy; no install, no venv): the
# python3 found on PATH without the venv (which has no torch), unless GPU_PYTHON names another.
GPU_PYTHON ?= $(shell PATH='$(subst $(abspath $(BIN)):,,$(PATH))' command -v python3)
.PHONY: gpu-check
gpu-check: ## on an NVIDIA GPU: read-only NVML inventory; restore/evict GB/s vs pinned host-to-device
	PYTHONPATH=operator $(GPU_PYTHON) -m arl_tangram.gpu.check

# ---- images and clusters ------------------------------------------------------------------------------
.PHONY: images cluster-up cluster-down kind-up kind-down deploy-kind e2e-kind
images: ## build the sandbox, operator and reward images with Docker, without a registry if need be (docs/images.md)
	@IMAGES=1 bash hack/system-deps.sh
	bash hack/images.sh

cluster-up: install ## start the local test bed (control plane built from source + simulated nodes)
	bash hack/cluster-up.sh

cluster-down: ## stop the local test bed: only the processes it started
	bash hack/cluster-down.sh

kind-up: ## create a kind cluster (needs Docker)
	bash hack/kind.sh up

kind-down: ## delete the kind cluster
	bash hack/kind.sh down

deploy-kind: images ## load the images into kind and deploy the operator
	bash hack/kind.sh deploy

e2e-kind: install ## run tests/e2e against the kind cluster
	bash hack/kind.sh e2e
