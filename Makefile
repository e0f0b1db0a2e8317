# Two commands: `make demo` (install, run the embedded model) and `make test` (install, run the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench docs

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/jstd demo

test: $(VENV)/.installed
	$(PY) -m pytest tests

docs: $(VENV)/.installed
	$(PY) -c 'from jstd.sites import values_markdown; print(values_markdown(), end="")' > docs/values.md

bench: $(VENV)/.installed
	$(PY) benchmarks/forward.py
