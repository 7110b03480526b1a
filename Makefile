# Both targets build .venv from nothing on a fresh machine, then do their job.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and exactly: a range would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,triton,ray]'
	touch $@

.PHONY: run test test-slow test-ray services bench router eval-report thinking-table
run: $(VENV)/.installed
	$(VENV)/bin/sluice serve --demo

test: $(VENV)/.installed services
	$(PY) -m pytest -q

# PostgreSQL and Redis for the shared-storage tests (tests/services.py starts throwaway
# servers on loopback), from the system packages when missing: CI runs as root on a fresh
# Debian. Without them those tests skip and say why.
services:
	@if ! command -v redis-server >/dev/null || \
	    ! { command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; }; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql redis-server; } \
		|| echo "make services: could not install postgresql and redis-server; the shared-storage tests will skip"; \
	fi

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

# Sluice on Ray Serve: two replicas of a tiny model on a local Ray, PostgreSQL and Redis
# (cache affinity against round robin, a replica killed under load). About 4 minutes on
# 2 cores, most of it Ray and the replicas starting; test-slow runs it too.
test-ray: $(VENV)/.installed services
	$(PY) -m pytest -q -m slow tests/test_ray_serve.py

bench: $(VENV)/.installed
	$(PY) benchmarks/engine_bench.py

# The router for the default models and the checked-in eval report (docs/eval-report/):
# labels from the train half of SQuAD + GSM8K, then both models on 300 questions of the test
# half. About an hour on 2 cores; `make eval-report` does both.
EVALS := .cache/evals
EVAL_SET := mixed --mix 2:1 --quant int8 --context-budget 512
router: $(VENV)/.installed
	$(VENV)/bin/sluice eval run $(EVAL_SET) -n 210 --split train --out $(EVALS)/train-mixed
	$(VENV)/bin/sluice train-router $(EVALS)/train-mixed

eval-report: router
	$(VENV)/bin/sluice eval run $(EVAL_SET) -n 300 --split test --router $(EVALS)/train-mixed/router.joblib \
		--out $(EVALS)/report-mixed-test
	# The cascade for real at the threshold the curves chose (95% of large-only quality).
	$(VENV)/bin/sluice eval run $(EVAL_SET) -n 300 --split test --router $(EVALS)/train-mixed/router.joblib \
		--modes routed+cascade --threshold 0.41 --out $(EVALS)/report-mixed-test
	mkdir -p docs/eval-report
	cd $(EVALS)/report-mixed-test && cp report.md summary.json quality_cost.png latency.png $(CURDIR)/docs/eval-report/

# GSM8K exact match by thinking budget (docs/thinking-budgets/): the report's 100 GSM8K
# problems at budgets 64, 256 and 1024; budget 0 is the report's own run. Hours on 2 cores.
THINK_RUNS := $(foreach b,64 256 1024,$(EVALS)/gsm8k-test-think$(b))
thinking-table: eval-report
	for b in 64 256 1024; do $(VENV)/bin/sluice eval run gsm8k -n 100 --split test --quant int8 \
		--thinking-budget $$b --concurrency 16 --out $(EVALS)/gsm8k-test-think$$b || exit 1; done
	$(VENV)/bin/sluice eval budgets $(EVALS)/report-mixed-test $(THINK_RUNS) --out docs/thinking-budgets \
		--router $(EVALS)/train-mixed/router.joblib
