# Quickstart targets: `make sample` and `make test`. Both create .venv and install what they need.
VENV ?= .venv
PY := $(VENV)/bin/python
FMNIST := /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: sample test lint venv data clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 is on local disk; installing it first keeps pip from fetching a CUDA build.
	$(PY) -m pip install -q torch==2.13.0 triton==3.9.0
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

venv: $(VENV)/.installed

data:
	@test -f $(FMNIST) || (DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q dataset-fashion-mnist)

sample: venv
	$(VENV)/bin/fastdiff sample --sampler dpmsolver++ --steps 20 --batch 36 --out samples/grid.png

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: venv data lint
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) samples .pytest_cache .ruff_cache
