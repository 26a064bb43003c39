# The two commands of the README: `make demo` (main job) and `make test` (test suite). Each creates .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Stamp files so a second `make` does not reinstall; they are rebuilt when pyproject.toml changes.
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.core

demo: $(VENV)/.core
	$(BIN)/tvmdm demo

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
