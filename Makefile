# The README's two commands: `make demo` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,dev,redis,postgres,mongo,spark
BACKEND ?= memory
BENCH_ARGS ?=

.PHONY: demo test lint bench services venv clean

$(VENV)/.installed-$(subst ,,$(EXTRAS)): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(VENV)/.installed-$(subst ,,$(EXTRAS))

demo: venv
	$(PY) examples/demo.py

services:
	bash tests/services.sh

test: venv services
	$(PY) -m pytest -q -p no:cacheprovider

lint: venv
	$(PY) -m ruff check aio_keuss tests bench examples
	$(PY) -m ruff format --check aio_keuss
	$(PY) -m mypy aio_keuss

bench: venv
	$(PY) -m bench --backend $(BACKEND) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
