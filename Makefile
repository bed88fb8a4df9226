# The README's two commands: `make demo` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_EXTRAS ?= test,dev,redis,postgres,mongo,spark
BACKEND ?= memory
BENCH_ARGS ?=

.PHONY: demo test lint bench bench-spark services clean

# One stamp per set of extras, so `make demo` installs little and `make test` everything.
$(VENV)/.stamp-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$*]'
	touch $@

demo: $(VENV)/.stamp-test
	$(PY) examples/demo.py

services:
	bash tests/services.sh

test: $(VENV)/.stamp-$(TEST_EXTRAS) services
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(VENV)/.stamp-$(TEST_EXTRAS)
	$(PY) -m ruff check aio_keuss tests bench examples
	$(PY) -m ruff format --check aio_keuss
	$(PY) -m mypy aio_keuss
	$(VENV)/bin/lint-imports

bench: $(VENV)/.stamp-$(TEST_EXTRAS) services
	$(PY) -m bench --backend $(BACKEND) $(BENCH_ARGS)

# Spark df.write into a queue, rows/s (BACKEND=redis-oq|redis-list|postgres|...).
bench-spark: $(VENV)/.stamp-$(TEST_EXTRAS) services
	$(PY) -m bench.spark_write --backend $(BACKEND) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
