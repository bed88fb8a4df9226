# The README's two commands: `make demo` and `make test`. Everything they need is installed here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TEST_EXTRAS ?= test,dev,redis,postgres,mongo,spark
BACKEND ?= memory
BENCH_ARGS ?=
PEERS_ARGS ?=
PEERS := bench/peers

.PHONY: demo test lint bench bench-instructions bench-peers bench-spark services clean

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
	$(PY) -m pytest -q -p no:cacheprovider -n 4 --dist loadgroup --durations=30 $(PYTEST_ARGS)

lint: $(VENV)/.stamp-$(TEST_EXTRAS)
	$(PY) -m ruff check aio_keuss tests bench examples
	$(PY) -m ruff format --check aio_keuss
	$(PY) -m mypy aio_keuss
	$(VENV)/bin/lint-imports

bench: $(VENV)/.stamp-$(TEST_EXTRAS) services
	$(PY) -m bench --backend $(BACKEND) $(BENCH_ARGS)

# Client instructions per message under callgrind, repeatable where timings are not
# (docs/benchmarks.md); e.g. BACKEND=redis-oq,postgres BENCH_ARGS="--rows pop,consume --base main".
# Installs Debian's valgrind (the tool and callgrind.h) and gcc when missing.
bench-instructions: $(VENV)/.stamp-$(TEST_EXTRAS) services
	@if ! command -v valgrind >/dev/null || ! command -v gcc >/dev/null \
	    || ! [ -f /usr/include/valgrind/callgrind.h ]; then \
	  sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$sudo apt-get update -qq && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind gcc >/dev/null; \
	fi
	$(PY) -m bench.instructions --backend $(BACKEND) $(BENCH_ARGS)

# aio-keuss beside Keuss 2.0.6 (Node), saq, arq, procrastinate and the servers' own limits, in one
# sitting, interleaved over repetitions (docs/benchmarks.md); e.g. PEERS_ARGS="--reps 3 --messages 20000".
bench-peers: $(VENV)/.stamp-$(TEST_EXTRAS) services $(PEERS)/node_modules/.stamp $(PEERS)/.venv/.stamp
	$(PY) -m bench.peers $(PEERS_ARGS)

# Keuss and its drivers exactly as package-lock.json pins them.
$(PEERS)/node_modules/.stamp: $(PEERS)/package-lock.json
	@command -v npm >/dev/null || { echo "bench-peers needs Node 20 and npm"; exit 1; }
	cd $(PEERS) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The Python peers in a venv of their own, so their dependencies never meet aio-keuss's.
$(PEERS)/.venv/.stamp: $(PEERS)/requirements.txt
	test -x $(PEERS)/.venv/bin/python || $(PYTHON) -m venv $(PEERS)/.venv
	$(PEERS)/.venv/bin/python -m pip install -q -r $(PEERS)/requirements.txt
	touch $@

# Spark df.write into a queue, rows/s (BACKEND=redis-oq|redis-list|postgres|...).
bench-spark: $(VENV)/.stamp-$(TEST_EXTRAS) services
	$(PY) -m bench.spark_write --backend $(BACKEND) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache $(PEERS)/.venv $(PEERS)/node_modules
