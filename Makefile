# Two commands do all the set-up on a fresh machine (see README):
#   make demo   - the main job: long-context comparison of RoPE schemes on the embedded model
#   make test   - the test suite (what CI runs), with README's and the docs' examples and the strict docs build
#   make docs   - the documentation site on http://127.0.0.1:8000 (mkdocs serve, live reload)
# Each creates .venv if missing. torch is installed first, pinned to the CPU build that lies on local disk
# (torch==2.13.0), so pip never resolves a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0

.PHONY: demo test test-fast docs bench lint clean

$(STAMP): pyproject.toml
	@echo "[1/4] creating the virtual environment $(VENV) ..."
	$(PYTHON) -m venv $(VENV)
	@echo "[2/4] upgrading pip ..."
	$(PY) -m pip install -q --upgrade pip
	@echo "[3/4] installing $(TORCH) (the CPU build; about a minute) ..."
	$(PY) -m pip install -q "$(TORCH)"
	@echo "[4/4] installing rope_patch and its dependencies (transformers, peft, lm-eval, the docs and test tools) ..."
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)
	@echo "installed: $(VENV) is ready."

demo: $(STAMP)
	$(VENV)/bin/rope-patch compare --model tiny --schemes default linear:4 ntk:8 dynamic:4 yarn:8 llama3:8 \
		--lengths 256 512 1024 2048 --out results/

# tests/, README.md and docs/ (pyproject's testpaths): every ```python block of the README and the docs runs as a test,
# and tests/test_docs.py builds the site with mkdocs build --strict
test: $(STAMP)
	$(PY) -m pytest -q --durations=15

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

# The core guarantees only (apply/remove, ownership, shipped scaling, specs, frequency exactness): a quick check
# while editing; `make test` is the full CI suite.
FAST_TESTS := tests/test_api.py tests/test_ownership.py tests/test_shipped_scaling.py tests/test_specs.py \
	tests/test_explain.py tests/schemes/test_frequency.py tests/test_rotation_math.py tests/test_layout.py
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(FAST_TESTS)

bench: $(STAMP)
	$(PY) bench/overhead.py

lint: $(STAMP)
	$(VENV)/bin/ruff check rope_patch tests bench recipes eval

clean:
	rm -rf $(VENV) results site .pytest_cache
