# Quickstart targets: `make run` (main job) and `make test` (the suite but its tests marked slow;
# `make test-slow` runs those, CI runs both). Each makes .venv first:
# Python 3.11 and the oldest stack the package supports (constraints/oldest.txt).
# `make test-newest` and `make test-newest-slow`: the same two on the newest supported Python
# found (.ci/newest-python) with the newest JAX and Flax pip resolves there, in .venv-newest;
# the tests held to the bits of the oldest stack's XLA skip there, saying so.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
NEWEST := .venv-newest

.PHONY: setup run test test-slow lint test-newest test-newest-slow

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml constraints/oldest.txt | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]' -c constraints/oldest.txt
	touch $@

setup: $(VENV)/.installed

run: setup
	$(BIN)/diloco-jax compare

test: setup
	$(BIN)/python -m pytest -m 'not slow'

test-slow: setup
	$(BIN)/python -m pytest -m slow

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

$(NEWEST)/.installed: pyproject.toml
	rm -rf $(NEWEST)
	python=$$(.ci/newest-python) && $$python -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip
	$(NEWEST)/bin/python -m pip install -q -e '.[dev]'
	touch $@

test-newest: $(NEWEST)/.installed
	$(NEWEST)/bin/python -c 'import sys, jax, flax; print("newest stack: Python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__)'
	$(NEWEST)/bin/python -m pytest -m 'not slow'

test-newest-slow: $(NEWEST)/.installed
	$(NEWEST)/bin/python -m pytest -m slow
