# The two commands of the README: `make demo` (main job) and `make test` (test suite). Each creates .venv itself.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Stamp files so a second `make` does not reinstall; they are rebuilt when pyproject.toml changes.
# pip's own progress is shown (no -q): the core is ~500 MB, the dev extra ~1.7 GB in all (README: Install).
$(VENV)/.core: pyproject.toml | $(BIN)/python
	@echo "installing tvmdm (core: TVM, onnx, onnxruntime, numpy; ~500 MB) into $(VENV) ..."
	$(BIN)/python -m pip install --progress-bar on -e .
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/python
	@echo "installing tvmdm with the dev extra (+ tune, plot, torch CPU, transformers, pytest; ~1.7 GB) into $(VENV) ..."
	$(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	touch $@ $(VENV)/.core

demo: $(VENV)/.core
	$(BIN)/tvmdm demo

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) *.egg-info
