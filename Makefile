# The two commands: `make run` serves a model, `make test` runs the whole suite.
# Each creates .venv and installs the project on first use, so each works alone on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
MODEL ?=
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/weir serve $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

# CPU benchmarks (not tests: CI does not run them). MODEL= benchmarks a real checkpoint instead.
BENCH_MODEL := $(if $(MODEL),--model $(MODEL),)
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m benchmarks.prefix_cache $(if $(MODEL),--model $(MODEL),)
	$(PY) -m benchmarks.offline $(BENCH_MODEL)
	$(PY) -m benchmarks.serving $(BENCH_MODEL)
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.attention || true  # GPU only; says so and skips on CPU
	$(PY) -m benchmarks.report

clean:
	rm -rf $(VENV) *.egg-info
