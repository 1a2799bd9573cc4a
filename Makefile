# Quickstart targets: `make sample` and `make test`. Both create .venv and install what they need.
# `make test-full` runs the slow tests that `make test` leaves out; CI (.ci/run) runs both.
VENV ?= .venv
PY := $(VENV)/bin/python
FMNIST := /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: sample test test-full lint venv data test-data clean chromium

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch 2.13.0 is on local disk; installing it first keeps pip from fetching a CUDA build.
	$(PY) -m pip install -q torch==2.13.0 triton==3.9.0
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

venv: $(VENV)/.installed

# Fashion-MNIST (training data, FD-FMNIST reference) is the Debian package dataset-fashion-mnist. `make data`
# installs it with apt-get, through sudo unless make runs as root. `make test` installs it only when it runs as
# root (CI does); otherwise it says so and the tests that read Fashion-MNIST are skipped.
data:
	@test -f $(FMNIST) || { echo "make data: installing the Debian package dataset-fashion-mnist with $(strip $(SUDO) apt-get)"; \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q dataset-fashion-mnist; }

test-data:
	@if [ -z "$(SUDO)" ]; then $(MAKE) --no-print-directory data; \
	elif [ ! -f $(FMNIST) ]; then echo "make test: no $(FMNIST) and not root: Fashion-MNIST tests skip (make data installs it)"; fi

# The browser test of the `fastdiff serve` page drives Debian's chromium through Playwright (never its own download).
# `make test` installs it only when it runs as root (CI does); otherwise it says so and the browser test skips.
chromium:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ -z "$(SUDO)" ]; then DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else echo "make test: no /usr/bin/chromium and not root: the browser test skips (sudo apt-get install chromium)"; fi

sample: venv
	$(VENV)/bin/fastdiff sample --sampler dpmsolver++ --steps 20 --batch 36 --out samples/grid.png
	# the bundled text-to-image preset: one row of 8 per Fashion-MNIST class prompt (fastdiff.train.text_to_image.canonical_prompts())
	$(VENV)/bin/fastdiff sample --model fashion-mnist-t2i --guidance 3 --batch 8 --steps 20 --sampler dpmsolver++ \
		--prompt "a photo of a t-shirt" --prompt "a photo of trousers" --prompt "a photo of a pullover" \
		--prompt "a photo of a dress" --prompt "a photo of a coat" --prompt "a photo of a sandal" \
		--prompt "a photo of a shirt" --prompt "a photo of a sneaker" --prompt "a photo of a bag" \
		--prompt "a photo of an ankle boot" --out samples/t2i-grid.png

# ruff (lint + format) and the import contracts of pyproject.toml's [tool.importlinter]: layers only import
# downwards (kernels < samplers < models < engine < pipelines < the commands) and no package has an import circle.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# make test: lint, then every test not marked slow (a few minutes on a 2-core CPU: one fast test of each area at least).
test: venv test-data chromium lint
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m "not slow"

# make test-full: the tests marked slow (engine vs diffusers, big fused models, torchrun, training runs, ...), the rest.
test-full: venv test-data chromium
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m slow

clean:
	rm -rf $(VENV) samples .pytest_cache .ruff_cache
