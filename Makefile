# dra-agent: `make run` starts the agent on an embedded default, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RUN    ?= .run
PB     := agent/pb/__init__.py

.PHONY: all setup test lint run bench stress hw-check nvml-standin clean

all: setup

$(STAMP): pyproject.toml setup.py
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is needed"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

$(PB): proto/*.proto proto/build.py $(STAMP)
	$(BIN)/python proto/build.py >/dev/null

setup: $(STAMP) $(PB)

lint: setup
	$(BIN)/ruff check agent cdi tests examples proto image
	$(BIN)/mypy agent cdi

test: lint nvml-standin
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The stand-in libnvidia-ml.so.1 (tests/nvml_standin/): the real pynvml path without a GPU. Built
# twice: the current driver's library, and an older driver's that lacks some functions.
STANDIN_DIR    := tests/nvml_standin
STANDIN        := $(STANDIN_DIR)/build
STANDIN_CC     ?= gcc
STANDIN_CFLAGS := -std=c11 -O2 -Wall -Wextra -Werror -fPIC -shared -fvisibility=hidden -Wl,-soname,libnvidia-ml.so.1

nvml-standin: $(STANDIN)/libnvidia-ml.so.1 $(STANDIN)/legacy/libnvidia-ml.so.1

STANDIN_SRC    := $(STANDIN_DIR)/nvml_standin.c $(STANDIN_DIR)/nvml_standin_mig.c

$(STANDIN)/libnvidia-ml.so.1 $(STANDIN)/legacy/libnvidia-ml.so.1: $(STANDIN_SRC) $(STANDIN_DIR)/nvml_standin.h $(STANDIN_DIR)/machine.txt
	mkdir -p $(@D)
	$(STANDIN_CC) $(STANDIN_CFLAGS) $(if $(findstring /legacy/,$@),-DSTANDIN_LEGACY) -o $@ $(STANDIN_SRC) -ldl
	cp $(STANDIN_DIR)/machine.txt $(@D)/machine.txt

# Simulated GPUs unless the NVML library loads; the host's NICs; offline under $(RUN)/
# unless a cluster is reachable and knows this node; everything else under $(RUN)/.
# Metrics and probes on a free local port (logged); DRA_METRICS_ADDRESS picks one, empty turns them off.
run: setup
	$(BIN)/python examples/seed.py $(RUN)
	$(BIN)/dra-agent run \
	  --nvml "$${DRA_NVML:-$$($(BIN)/python -m agent.inventory.gpus --probe)}" \
	  --offline-fallback $(RUN)/offline \
	  --kubelet-dir $(RUN)/kubelet --cdi-dir $(RUN)/cdi --static-cdi-dir $(RUN)/cdi-static \
	  --state-dir $(RUN)/state \
	  --metrics-address "$${DRA_METRICS_ADDRESS-127.0.0.1:0}" $(ARGS)

bench: setup
	$(BIN)/python tests/bench/bench.py $(ARGS)

# The crash suite and the fuzzer (tests/stress/stress.py): >= 1,000 SIGKILLs, >= 10,000 inputs.
stress: setup
	$(BIN)/python tests/stress/stress.py $(ARGS)

hw-check: setup
	$(BIN)/python -m pytest -q -rs tests/hw

# The container image (Containerfile; README "Container image"): from a registry's Python base, the
# wheels from PyPI. IMAGE names it, IMAGE_BASE is the base.
IMAGE      ?= localhost/dra-agent:latest
IMAGE_BASE ?= docker.io/library/python:3.11-slim-bookworm

.PHONY: image image-offline
image:
	podman build --build-arg BASE=$(IMAGE_BASE) --tag $(IMAGE) --file Containerfile .

# The same image with no registry, as CI builds it (image/build.py): a Debian base made here by
# mmdebstrap, the wheels downloaded here into .image/wheels, and no network in the build.
image-offline: $(STAMP)
	$(BIN)/python image/build.py --tag $(IMAGE)

clean:
	rm -rf $(RUN) .bench .stress build dist *.egg-info agent/pb $(STANDIN)
