# Two commands do all the set-up on a fresh machine:
#   make demo   - create the environment if needed, then a 2-process compressed training run
#   make test   - install what is needed, then run the test suite
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CACHE ?= .cache
PINS := requirements/pins.txt
# Re-install when any of these change.
STAMP := $(VENV)/.cgx-installed
EXT_SRC := $(wildcard cgx/csrc/*.c cgx/csrc/*.h)
PYTEST_ARGS ?=

.PHONY: demo test install system ext horovod bench bench-kernels bench-allreduce docs clean distclean help

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

$(STAMP): $(PY) setup.cfg setup.py pyproject.toml $(PINS)
	@./scripts/install-system-deps.sh
	$(PIP) install -q -c $(PINS) setuptools wheel pip
	$(PIP) install -q -c $(PINS) --no-build-isolation -e ".[all,dev,docs]"
	touch $@

# The C extension (fast CPU path) is rebuilt in place when its sources change.
ext: $(STAMP) $(EXT_SRC)
	@$(PY) scripts/build_ext.py

install: $(STAMP) ext

# Horovod 0.28.1 built against the pinned torch/TensorFlow, cached under $(CACHE)/wheels.
horovod: install
	@./scripts/build-horovod.sh $(PY) $(CACHE)/wheels

demo: install
	$(VENV)/bin/cgxrun -np 2 $(PY) examples/demo.py

# Two parts: most tests on TEST_WORKERS processes (pytest-xdist: a multi-rank test leaves
# cores idle while its ranks wait on each other; an idle worker takes queued tests from a
# busy one), then the `serial` ones alone (they assert timing; tests/conftest.py lists
# them). Each part fails if it collects no test.
TEST_WORKERS ?= 2
test: install horovod
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not serial" $(PYTEST_ARGS)
	$(PY) -m pytest -m serial $(PYTEST_ARGS)

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

distclean: clean
	rm -rf $(VENV) $(CACHE)
