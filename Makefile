# Two commands: `make demo` and `make test`. Each creates .venv when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first, pinned, so pip does not pull a multi-GB CUDA build on a CPU machine.
# On a GPU machine: make demo TORCH_SPEC="torch" (or any CUDA build you prefer).
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint compat compat-args venv install install-test clean

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

# The DPO recipe on the embedded tiny model with recipes/configs/dpo.yaml, streamed through one device
# buffer (every layer change is a host-to-device load, as for a model much larger than the device),
# ending with the summary table and demo_output/run.png. A fresh run each time (train.log.jsonl is
# appended to, for resumed runs). One thread: the tiny model gains nothing from more, and loses a
# lot when the cores are shared.
demo: $(VENV)/.installed
	rm -rf demo_output
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 $(PY) recipes/dpo.py --config recipes/configs/dpo.yaml \
		--stream_buffers 1 --summary true --output_dir demo_output

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check deg_hf tests scripts $(wildcard recipes)

test: $(VENV)/.installed-test lint
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest tests

# TRL's own DPO and KTO test files, unchanged and offline, against plain TRL (the baseline), deg_hf
# resident and deg_hf streamed: make compat TRL_TESTS=/path/to/trl/tests (a TRL checkout's tests/).
$(VENV)/.installed-compat: $(VENV)/.installed-test
	$(PY) -m pip install -q -e ".[compat]"
	touch $@

compat-args:
	@test -n "$(TRL_TESTS)" || { echo "usage: make compat TRL_TESTS=/path/to/trl/tests"; exit 2; }

compat: compat-args $(VENV)/.installed-compat
	HF_HUB_OFFLINE=1 $(PY) scripts/compat/run.py --trl-tests "$(TRL_TESTS)"

clean:
	rm -rf $(VENV) build *.egg-info demo_output
