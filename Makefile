# The README's two commands. Each creates .venv on first use and installs what it needs:
# the CPU build of torch (pinned: a plain `torch` would pull a multi-GB CUDA build), the triton
# that matches the GPU machines, and moefuse itself in editable mode with its test, bench and
# transformers extras. `make test` also checks the packaging once (stamped; re-run when
# pyproject.toml or the check changes): the wheel builds without setuptools deprecation
# warnings and installs and runs in a throwaway venv (scripts/check_wheel.sh).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moefuse-installed
WHEEL_STAMP := $(VENV)/.moefuse-wheel-checked

.PHONY: demo test test-quick lint wheel-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 triton==3.6.0
	$(PY) -m pip install -q -e '.[test,bench,transformers]' ruff
	touch $(STAMP)

$(WHEEL_STAMP): $(STAMP) pyproject.toml scripts/check_wheel.sh
	bash scripts/check_wheel.sh $(VENV)
	touch $(WHEEL_STAMP)

wheel-check: $(WHEEL_STAMP)

demo: $(STAMP)
	$(PY) -m moefuse demo

#: pytest-xdist workers: the interpreter tests are CPU-bound and one process uses about one
#: core (its threads share the GIL), so one worker per core of the 2-core CI machine
TEST_WORKERS ?= 2

test: $(STAMP) $(WHEEL_STAMP)
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=15 tests

# the quick subset while editing: no groups of ranks, no scripts in fresh interpreters (`slow`)
test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV)
