# `make demo` and `make test` are the two commands a new user (and CI) runs.
# Both are idempotent: they create .venv when absent and install the project into it.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR ?= models/bench-llama

.PHONY: demo test lint bench clean-venv

$(VPY):
	$(PY) -m venv $(VENV)

# torch first, pinned, when none is importable: a bare `torch` requirement would pull a
# multi-GB CUDA build on a CPU machine.
$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m launch.demo --model $(MODEL_DIR)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q -x

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(VPY) -m launch.cli bench offline --model $(MODEL_DIR)

clean-venv:
	rm -rf $(VENV)
