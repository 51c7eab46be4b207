# Two commands do all the set-up on a fresh machine (see README):
#   make demo   - the main job: long-context comparison of RoPE schemes on the embedded model
#   make test   - the test suite (what CI runs), with README's and the docs' examples and the strict docs build
#   make docs   - the documentation site on http://127.0.0.1:8000 (mkdocs serve, live reload)
# Each creates .venv if missing. torch is installed first, pinned (torch==2.13.0) so that the dependencies never pull
# another release. Which build that is depends on the index: on this project's machines a CPU build on local disk;
# from the public index the CUDA build (several GB), unless TORCH_INDEX names PyTorch's CPU index:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_FROM := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))

.PHONY: demo test test-fast test-compat docs bench lint clean

$(STAMP): pyproject.toml
	@echo "[1/4] creating the virtual environment $(VENV) ..."
	$(PYTHON) -m venv $(VENV)
	@echo "[2/4] upgrading pip ..."
	$(PY) -m pip install -q --upgrade pip
	@echo "[3/4] installing $(TORCH) $(TORCH_FROM) (about a minute from local disk; a CUDA build from the public index is GBs) ..."
	$(PY) -m pip install -q "$(TORCH)" $(TORCH_FROM)
	@echo "[4/4] installing rope_patch and its dependencies (transformers, peft, lm-eval, the docs and test tools) ..."
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)
	@echo "installed: $(VENV) is ready."

demo: $(STAMP)
	$(VENV)/bin/rope-patch compare --model tiny --schemes default linear:4 ntk:8 dynamic:4 yarn:8 llama3:8 \
		--lengths 256 512 1024 2048 --out results/ --overwrite

# tests/, README.md and docs/ (pyproject's testpaths): every ```python block of the README and the docs runs as a test,
# and tests/test_docs.py builds the site with mkdocs build --strict
# The suite runs in TEST_WORKERS processes (pytest-xdist): one per CPU this process may use, at most 4 (each test
# runs on one torch thread, tests/conftest.py). `make test TEST_WORKERS=0` runs it in this process, one test at a time.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; a = getattr(os, 'sched_getaffinity', None); \
	print(min(4, len(a(0)) if a else os.cpu_count() or 1))")
XDIST := -n $(TEST_WORKERS)

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 $(XDIST)

docs: $(STAMP)
	$(VENV)/bin/mkdocs serve

# The core guarantees only (apply/remove, ownership, shipped scaling, specs, frequency exactness): a quick check
# while editing; `make test` is the full CI suite.
FAST_TESTS := tests/test_api.py tests/test_ownership.py tests/test_shipped_scaling.py tests/test_specs.py \
	tests/test_explain.py tests/schemes/test_frequency.py tests/test_rotation_math.py tests/test_layout.py
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(FAST_TESTS)

# The old end of the supported transformers window, in a venv of its own: SGLang 0.5.23 pins transformers 5.19.0 and
# vLLM 0.34 takes >=5.16.1,<5.23 (tested beside their versions, without installing either: they pull a CUDA torch).
# A shorter pass than `make test`: the core guarantees, what older releases refuse, and the architecture coverage.
# `make test-compat COMPAT_VERSION=5.22.0` runs it on another release (installed into the same venv).
VENV_COMPAT ?= .venv-compat
COMPAT_VERSION ?= 5.19.0
STAMP_COMPAT := $(VENV_COMPAT)/.installed-$(COMPAT_VERSION)
COMPAT_TESTS := $(FAST_TESTS) tests/schemes/test_older_transformers.py tests/schemes/test_architectures.py

$(STAMP_COMPAT): pyproject.toml
	$(PYTHON) -m venv $(VENV_COMPAT)
	$(VENV_COMPAT)/bin/python -m pip install -q --upgrade pip
	$(VENV_COMPAT)/bin/python -m pip install -q "$(TORCH)" $(TORCH_FROM)
	$(VENV_COMPAT)/bin/python -m pip install -q -e ".[dev]" "transformers==$(COMPAT_VERSION)"
	rm -f $(VENV_COMPAT)/.installed-*
	touch $(STAMP_COMPAT)

test-compat: $(STAMP_COMPAT)
	$(VENV_COMPAT)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	$(VENV_COMPAT)/bin/python -m pytest -q --durations=10 $(XDIST) $(COMPAT_TESTS)

bench: $(STAMP)
	$(PY) bench/overhead.py

lint: $(STAMP)
	$(VENV)/bin/ruff check rope_patch tests bench recipes eval

clean:
	rm -rf $(VENV) $(VENV_COMPAT) results site .pytest_cache
