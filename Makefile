# Two entry points for a fresh clone: `make demo` (the main job) and `make test` (everything).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export NIXL_LOG_LEVEL ?= WARN
export HF_HUB_OFFLINE := 1
export VLLM_TARGET_DEVICE := cpu
export PYTHONHASHSEED ?= 0

.PHONY: venv deps build test test-fast demo plan bench bench-gate clean

$(VENV)/.stamp-base: requirements/test.txt requirements/nixl.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements/test.txt
	$(PIP) install -q --no-deps -r requirements/nixl.txt
	touch $@

$(VENV)/.stamp-mooncake: requirements/mooncake.txt $(VENV)/.stamp-base
	@if ! ldconfig -p | grep -q libibverbs.so.1; then \
	  (apt-get update -qq && apt-get install -y -qq libibverbs1) || echo "warning: libibverbs1 not installed"; fi
	$(PIP) install -q -r requirements/mooncake.txt
	touch $@

$(VENV)/.stamp-vllm: requirements/vllm-lean.txt scripts/install_vllm.sh $(VENV)/.stamp-base
	bash scripts/install_vllm.sh $(VENV)
	touch $@

venv: $(VENV)/.stamp-base
deps: $(VENV)/.stamp-base $(VENV)/.stamp-mooncake $(VENV)/.stamp-vllm

build: $(VENV)/.stamp-base
	$(PY) setup.py -q build_ext --inplace --parallel 2

test: deps build
	$(PY) -m pytest -q

test-fast: build
	$(PY) -m pytest -q -m "not nixl and not mooncake and not vllm and not slow"

demo: $(VENV)/.stamp-base build
	@if $(PY) -c 'import hmacore.demo' 2>/dev/null; then $(PY) -m hmacore demo $(DEMO_ARGS); \
	else $(PY) -m hmacore plan --preset gpt-oss-120b --tokens 32768; fi

plan: build
	$(PY) -m hmacore plan --preset deepseek-v4 --tokens 32768

bench: deps build
	$(PY) -m pytest -q bench --benchmark-only

clean:
	rm -rf build hmacore/_fast/*.c hmacore/_fast/*.so .pytest_cache .benchmarks
