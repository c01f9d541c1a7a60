# The two commands a fresh machine needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

.PHONY: venv demo test test-all test-gpu lint bench gpu-bundle clean

venv: $(STAMP)

# torch first, pinned: the CPU build lies on local disk; an unpinned torch would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# The RL demo on the tiny DeepSeek-V4: a short SFT warm start, then DAPO from its weights, each
# submitted with `ray job submit` to a local Ray cluster (127.0.0.1, token auth) started for it
# and stopped after it. Prints held-out accuracy before and after RL and where the plots are.
DEMO := runs/demo-$(shell date +%Y%m%d-%H%M%S)
demo: venv
	$(BIN)/miles submit jobs/dapo_tiny_sft.yaml log.run_dir=$(DEMO)/sft
	$(BIN)/miles submit jobs/dapo_tiny.yaml ckpt.hf=$(DEMO)/sft/hf log.run_dir=$(DEMO)/dapo --report

# Two workers (the CI machine's 2 cores): a file's tests on one worker, the longest files first
# (tests/conftest.py). `.venv/bin/python -m pytest tests/test_x.py` runs one file on its own.
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadfile --no-loadscope-reorder
test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PARALLEL)

# Everything make test runs (every parallel layout, the five combined ones included), plus
# every layout in bf16 against one process's bf16 errors as the GPUs run them (about 2.5 minutes).
test-all: test
	$(BIN)/python -m pytest tests/test_parallel_layouts.py --bf16 -k layout_matches

# On a CUDA machine (no venv there: scripts/gpu_install.sh puts the service on its python3): the
# GPU-capable tests with the GPUs visible (make test hides them: the CPU suite on any machine).
test-gpu:
	MILES_TEST_GPU=1 $(PY) -m pytest tests/gpu tests/test_kernels.py tests/test_ops.py -q

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: venv
	$(BIN)/python benchmarks/model_cpu.py

# The service's Python dependencies for a GPU machine without network (scripts/gpu_bundle.py):
# .whl/site.parts and .whl/site.tar.xz.N, each part carried by one device call and installed
# there by scripts/gpu_install.sh (README: "A GPU machine without network").
gpu-bundle: venv
	$(BIN)/python scripts/gpu_bundle.py

clean:
	rm -rf $(VENV) .pytest_cache
