# Both targets build .venv from nothing on a fresh machine, then do their job.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and exactly: a range would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,triton]'
	touch $@

.PHONY: run test test-slow bench
run: $(VENV)/.installed
	$(VENV)/bin/sluice serve --demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

bench: $(VENV)/.installed
	$(PY) benchmarks/engine_bench.py
