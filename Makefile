# The two commands a fresh machine needs: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

.PHONY: venv demo test lint bench clean

venv: $(STAMP)

# torch first, pinned: the CPU build lies on local disk; an unpinned torch would pull a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

# SFT of the tiny DeepSeek-V4 on the bundled chat data, submitted with `ray job submit` to a
# local Ray cluster (127.0.0.1, token auth) started for it and stopped after it.
demo: venv
	$(BIN)/miles submit jobs/sft_tiny.yaml --report

test: venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: venv
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: venv
	$(BIN)/python benchmarks/model_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache
