# `make demo` and `make test` are the two commands a new user (and CI) runs.
# Both are idempotent: they create .venv when absent and install the project into it.
#
# Every package is installed at the version constraints.txt names: the set the suite last passed with, so
# a release made after it cannot break a fresh clone. `make test-latest` runs the same suite on the newest
# releases (in .venv-latest), so drift shows up in a run; `make lock` then writes those versions into
# constraints.txt. torch stays pinned in both.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LATEST := .venv-latest
LOCK := constraints.txt
MODEL_WHEELS := requirements-models.txt
TORCH := torch==2.13.0
BENCH_MODEL ?= models/bench-llama
# llama.cpp's own GGUF converters (convert_hf_to_gguf.py, convert_lora_to_gguf.py, conversion/, gguf-py), unpacked from
# the llama-cpp-python sdist that vendors llama.cpp: the slow tier holds the engine to files written by a
# converter that is neither ours nor the tests' (benchmarks/llama_convert.py). Nothing is built.
LLAMACPP_SDIST := llama-cpp-python==0.3.36
CONVERTER := llama.cpp/convert_lora_to_gguf.py
# Debian's chromium and its chromedriver, for tests/test_chat_browser.py: apt keeps the two at one version,
# and with both named Selenium never downloads a browser. Installed once, as root or through sudo.
CHROMEDRIVER := /usr/bin/chromedriver
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: demo test test-slow lint bench test-latest lock clean-venv browser

$(VPY):
	$(PY) -m venv $(VENV)

# torch first, pinned, when none is importable: a bare `torch` requirement would pull a multi-GB CUDA
# build on a CPU machine. The project is built without isolation, so its setuptools is the locked one too.
$(STAMP): $(VPY) pyproject.toml setup.py $(LOCK) $(MODEL_WHEELS)
	$(VPY) -m pip install -q -c $(LOCK) pip setuptools
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q -c $(LOCK) $(TORCH)
	$(VPY) -m pip install -q -c $(LOCK) --no-build-isolation -e '.[test]'
	$(VPY) -m pip install -q --no-deps -r $(MODEL_WHEELS)
	touch $(STAMP)

# $(call converter,VENV): llama.cpp's converter into VENV/llama.cpp (whole or not at all).
define converter
	rm -rf $(1)/llama.cpp $(1)/llama.cpp.part && mkdir -p $(1)/llama.cpp.part
	$(1)/bin/python -m pip download -q --no-binary :all: --no-deps -d $(1)/llama.cpp.part $(LLAMACPP_SDIST)
	tar -xzf $(1)/llama.cpp.part/*.tar.gz -C $(1)/llama.cpp.part --strip-components=3 --wildcards \
	  '*/vendor/llama.cpp/convert_hf_to_gguf.py' '*/vendor/llama.cpp/convert_lora_to_gguf.py' \
	  '*/vendor/llama.cpp/conversion/*' '*/vendor/llama.cpp/gguf-py/*'
	rm $(1)/llama.cpp.part/*.tar.gz && mv $(1)/llama.cpp.part $(1)/llama.cpp
endef

$(VENV)/$(CONVERTER): $(STAMP)
	$(call converter,$(VENV))

$(CHROMEDRIVER):
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	  chromium chromium-driver

browser: $(CHROMEDRIVER)

# Pulls SmolLM2-135M-Instruct into models/ when absent (from the installed wheel; nothing is downloaded).
demo: $(STAMP)
	$(VPY) -m tandem.launch.demo

# Everything but the tests marked slow (real weights and the soak), in under 10 minutes on 2 cores;
# `make test-slow` runs those, and CI (.ci/run) runs both.
test: $(STAMP) $(CHROMEDRIVER)
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q -m "not slow" --durations=25

test-slow: $(STAMP) $(VENV)/$(CONVERTER)
	$(VPY) -m pytest -q -m slow --durations=10

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	test -f $(BENCH_MODEL)/config.json || $(VPY) -m tandem.launch.cli make-model --arch llama --size bench --out $(BENCH_MODEL)
	$(VPY) -m tandem.launch.cli bench offline --model $(BENCH_MODEL)

# The whole suite on today's newest releases of everything but torch, in a venv made anew.
test-latest: $(CHROMEDRIVER)
	rm -rf $(LATEST)
	$(PY) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip setuptools
	$(LATEST)/bin/python -m pip install -q $(TORCH)
	$(LATEST)/bin/python -m pip install -q --upgrade --no-build-isolation -e '.[test]'
	$(LATEST)/bin/python -m pip install -q --no-deps -r $(MODEL_WHEELS)
	$(call converter,$(LATEST))
	$(LATEST)/bin/ruff check .
	$(LATEST)/bin/python -m pytest -q --durations=25  # both tiers

# Writes the versions of .venv-latest (after a green `make test-latest`) into the lock.
lock:
	test -x $(LATEST)/bin/python || { echo "run make test-latest first"; exit 1; }
	{ echo "# Written by 'make lock' on $$(date -u +%F) from the newest releases 'make test-latest' passed with."; \
	  echo "# Python $$($(LATEST)/bin/python -c 'import platform; print(platform.python_version())'); refresh: make test-latest lock"; \
	  $(LATEST)/bin/python -m pip freeze --all --exclude-editable \
	    $$(grep -v '^#' $(MODEL_WHEELS) | cut -d= -f1 | sed 's/^/--exclude /') \
	    | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)

clean-venv:
	rm -rf $(VENV) $(LATEST)
