# `make demo` and `make test` work on a fresh machine: each creates .venv when missing and
# installs what it needs. torch is installed first, pinned, so pip never resolves a multi-GB
# CUDA build on a CPU machine (set TORCH_SPEC to choose another build).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip --disable-pip-version-check
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Both cores: the default suite takes about 10 minutes this way on 2 cores (pytest-xdist, dev extra).
PYTEST_WORKERS ?= 2

.PHONY: demo demo-quick test test-all lint bench venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	@touch $@

$(VENV)/.deps-demo: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e '.[export]'
	@touch $@

$(VENV)/.deps-test: pyproject.toml $(VENV)/.torch
	$(PIP) install -q -e '.[all,dev]'
	@touch $@ $(VENV)/.deps-demo

venv: $(VENV)/.deps-test

demo: $(VENV)/.deps-demo
	$(VENV)/bin/gptforge demo --out runs/demo

demo-quick: $(VENV)/.deps-demo
	$(VENV)/bin/gptforge demo --quick --out runs/demo-quick

test: $(VENV)/.deps-test
	$(PY) -m pytest -q -m "not slow" -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Nightly: the whole suite including slow tests.
test-all: $(VENV)/.deps-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.deps-test
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

clean:
	rm -rf runs .pytest_cache build *.egg-info src/*.egg-info
