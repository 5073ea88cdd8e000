# `make run` and `make test` each create or reuse .venv by themselves.
# torch (and on Linux triton) are installed pinned first, so every run gets the same versions:
# an unpinned torch resolve pulls several GB of CUDA wheels, and pyproject.toml only bounds both.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the architecture preset `make run` trains (shardmoe/train/presets.py): make run ARCH=NAME
ARCH   ?= mixtral

.PHONY: run test venv clean gpu-check

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 "triton==3.9.0; platform_system == 'Linux'"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m shardmoe train --overwrite --arch $(ARCH)

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info

# the GPU check (docs/gpu.md), run by the machine's own python without a venv (a lent GPU machine has
# torch, triton and transformers installed and no network): make gpu-check OUT=DIR [ONLY=parity,bench]
# [ARGS="--budget 480"]
GPU_PYTHON ?= python
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) -m shardmoe.tools.gpu_check $(if $(OUT),--out $(OUT)) $(if $(ONLY),--only $(ONLY)) $(ARGS)
