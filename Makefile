# `make run` and `make test` each create or reuse .venv by themselves.
# torch is installed pinned first: an unpinned resolve pulls several GB of CUDA wheels.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# the architecture preset `make run` trains (shardmoe/train/presets.py): make run ARCH=NAME
ARCH   ?= mixtral

.PHONY: run test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m shardmoe train --overwrite --arch $(ARCH)

test: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
