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

# Two pytest-xdist workers (one per core of the CI VMs): most of the suite's time is single-threaded compiling,
# so it ends sooner (2-core AMD EPYC VMs: 21-22 min, where serial runs took 23-26); worksteal evens out the
# minute-long tests at the end.
test: $(VENV)/.dev
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

clean:
	rm -rf $(VENV) *.egg-info
