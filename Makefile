# Two commands: `make demo` and `make test`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first, pinned, so pip does not pull a multi-GB CUDA build on a CPU machine.
# On a GPU machine: make demo TORCH_SPEC="torch" (or any CUDA build you prefer).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint venv install install-test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[plot]"
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/bin/python
install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	HF_HUB_OFFLINE=1 $(PY) scripts/demo.py

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check deg_hf tests scripts $(wildcard recipes)

test: $(VENV)/.installed-test lint
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest tests

clean:
	rm -rf $(VENV) build *.egg-info demo_output
