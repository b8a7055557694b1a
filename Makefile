# The README's two commands. Each creates .venv on first use and installs what it needs:
# the CPU build of torch (pinned: a plain `torch` would pull a multi-GB CUDA build), the triton
# that matches the GPU machines, and moefuse itself in editable mode.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moefuse-installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0
	$(PY) -m pip install -q -e '.[test,bench]' ruff
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moefuse demo

test: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m pytest -q --durations=15 tests

clean:
	rm -rf $(VENV)
