# Two commands do all the set-up on a fresh machine:
#   make demo   - create the environment if needed (cgx, torch, its extension), then a
#                 2-process compressed training run
#   make test   - install everything the tests need, then run the test suite
#   make test-fast - the unit tier and one 2-rank smoke per framework (minutes)
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Built artifacts that outlive a clone (the Horovod wheel): a user cache, keyed inside by
# Python, torch, TensorFlow, MPI and CPU flags. Reused when present, never required.
CACHE ?= $(or $(CGX_CACHE_DIR),$(XDG_CACHE_HOME),$(HOME)/.cache)$(if $(CGX_CACHE_DIR),,/cgx)
PINS := requirements/pins.txt
# Re-install when any of these change: the demo's environment (cgx and torch) and the
# whole one (TensorFlow, the trainers, the docs toolchain, the test tools).
DEPS := $(PY) setup.cfg setup.py pyproject.toml $(PINS)
DEMO_STAMP := $(VENV)/.cgx-installed-demo
STAMP := $(VENV)/.cgx-installed
EXT_SRC := $(wildcard cgx/csrc/*.c cgx/csrc/*.h)
PYTEST_ARGS ?=

.PHONY: demo test test-fast install install-demo system ext ext-demo horovod bench bench-kernels bench-allreduce docs clean distclean help

help:
	@echo "make demo    - set up (if needed) and run a 2-rank compressed training demo"
	@echo "make test    - set up (if needed) and run the test suite"
	@echo "make bench   - time to accuracy: every method, 1/10 Gbit/s and unshaped links,"
	@echo "               2 hosts x 2 ranks, 3-seed accuracy study (4-6 hours; docs/results/train.*)"
	@echo "make bench-kernels / bench-allreduce - benchmarks (figures, plots)"
	@echo "make docs    - build the documentation site into site/ (mkdocs build --strict)"

system:
	@./scripts/install-system-deps.sh

$(PY):
	$(PYTHON) -m venv $(VENV)

# The whole environment includes the demo's: installing it satisfies both stamps.
$(DEMO_STAMP): $(DEPS)
	@if [ -f $(STAMP) ] && [ ! $(STAMP) -ot $@ ] && [ -z "$$(find $(DEPS) -newer $(STAMP))" ]; \
	then touch $@; exit 0; fi; \
	./scripts/install-system-deps.sh --demo && \
	$(PIP) install -q -c $(PINS) setuptools wheel pip && \
	$(PIP) install -q -c $(PINS) --no-build-isolation -e ".[demo]" && touch $@

$(STAMP): $(DEPS)
	@./scripts/install-system-deps.sh
	$(PIP) install -q -c $(PINS) setuptools wheel pip
	$(PIP) install -q -c $(PINS) --no-build-isolation -e ".[all,dev,docs]"
	touch $@ $(DEMO_STAMP)

# The C extension (fast CPU path) is rebuilt in place when its sources change.
ext: $(STAMP) $(EXT_SRC)
	@$(PY) scripts/build_ext.py

ext-demo: $(DEMO_STAMP) $(EXT_SRC)
	@$(PY) scripts/build_ext.py

install: $(STAMP) ext
install-demo: $(DEMO_STAMP) ext-demo

# Horovod 0.28.1 built against the pinned torch/TensorFlow, cached under $(CACHE)/wheels.
horovod: install
	@./scripts/build-horovod.sh $(PY) $(CACHE)/wheels

demo: install-demo
	$(VENV)/bin/cgxrun -np 2 $(PY) examples/demo.py

# Two parts: most tests on TEST_WORKERS processes (pytest-xdist: a multi-rank test leaves
# cores idle while its ranks wait on each other; an idle worker takes queued tests from a
# busy one), then the `serial` ones alone (they assert timing; tests/conftest.py lists
# them). Each part fails if it collects no test, prints its 30 slowest tests and its wall
# time.
TEST_WORKERS ?= 2
DURATIONS := --durations=30 --durations-min=1
test: install horovod
	@./scripts/timed.sh "parallel part" $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal \
	  -m "not serial" $(DURATIONS) $(PYTEST_ARGS)
	@./scripts/timed.sh "serial part" $(PY) -m pytest -m serial $(DURATIONS) $(PYTEST_ARGS)

# While working: the unit tier (no real ranks) and one 2-rank smoke per framework
# (tests marked `smoke`). Not a substitute for `make test`.
test-fast: install
	@./scripts/timed.sh "fast tier" $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal \
	  -m "smoke or not (multiproc or slow or serial or horovod or netns or browser or gpu)" \
	  $(DURATIONS) $(PYTEST_ARGS)

# Not part of `make test`: 4-6 hours on 2 cores (needs root for the simulated links).
# BENCH_ARGS=--resume keeps the runs already in docs/results/train.json.
BENCH_ARGS ?=
bench: install horovod
	$(PY) benchmarks/train.py --suite --out docs/results/train $(BENCH_ARGS)

bench-kernels: install
	$(PY) benchmarks/kernels.py

bench-allreduce: install
	$(PY) benchmarks/allreduce.py

# The documentation site (mkdocs.yml): strict, so a broken link or nav entry fails; the
# configuration reference is generated from cgx/config.py during the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf site build *.egg-info cgx/*.so .pytest_cache .hypothesis
	find . -name __pycache__ -prune -exec rm -rf {} +

# The user cache ($(CACHE)) is shared by every clone: remove it by hand if wanted.
distclean: clean
	rm -rf $(VENV) .cache
