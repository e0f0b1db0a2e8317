# Two commands: `make demo` (install with matplotlib for the figures, run the embedded model) and `make test` (install, run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench docs aot circuit-tracer

$(VENV)/.core: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.core
	$(PY) -m pip install -q -e '.[test]'
	touch $@

$(VENV)/.bench: $(VENV)/.test
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# `make aot`: the compilers of the aot extra (libtpu, the CUDA plugin, ptxas, triton), so `make test` also runs
# tests/test_aot.py (skipped without them); CI installs them
$(VENV)/.aot: $(VENV)/.test
	$(PY) -m pip install -q -e '.[test,aot]'
	touch $@

aot: $(VENV)/.aot

$(VENV)/.demo: $(VENV)/.core
	$(PY) -m pip install -q -e '.[plots]'
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/jstd demo

# the suite is mostly XLA compiles, one core each: one worker per core (of 2), each test file on one worker so
# its module fixtures are built once, in the order tests/conftest.py gives (the files of a few minute-long tests
# first, so that no worker idles at the end); TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2

test: $(VENV)/.test
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

docs: $(VENV)/.core
	$(PY) -c 'from jstd.families import values_markdown; print(values_markdown(), end="")' > docs/values.md
	$(PY) -c 'from jstd.families import families_markdown; print(families_markdown(), end="")' > docs/families.md

bench: $(VENV)/.bench
	for b in forward patching gated_delta olmo_hybrid qwen3_5 vision; do $(PY) benchmarks/$$b.py; done

# `make circuit-tracer`: circuit-tracer 0.5.0's own environment in .venv-ct (it pins transformers <= 4.57.3, so it
# cannot share .venv); `.venv-ct/bin/python scripts/circuit_tracer/reference.py` regenerates tests/data/circuit_tracer
circuit-tracer:
	bash scripts/circuit_tracer/setup.sh
