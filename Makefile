# dra-agent: `make run` starts the agent on an embedded default, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RUN    ?= .run
PB     := agent/pb/__init__.py

.PHONY: all setup test lint run bench stress hw-check clean

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
	$(BIN)/ruff check agent cdi tests examples proto
	$(BIN)/mypy agent cdi

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# Simulated GPUs unless the NVML library loads; the host's NICs; offline under $(RUN)/
# unless a cluster is reachable and knows this node; everything else under $(RUN)/.
run: setup
	$(BIN)/python examples/seed.py $(RUN)
	$(BIN)/dra-agent run \
	  --nvml "$${DRA_NVML:-$$($(BIN)/python -m agent.inventory.gpus --probe)}" \
	  --offline-fallback $(RUN)/offline \
	  --kubelet-dir $(RUN)/kubelet --cdi-dir $(RUN)/cdi --static-cdi-dir $(RUN)/cdi-static \
	  --state-dir $(RUN)/state $(ARGS)

bench: setup
	$(BIN)/python tests/bench/bench.py $(ARGS)

# The crash suite and the fuzzer (tests/stress/stress.py): >= 1,000 SIGKILLs, >= 10,000 inputs.
stress: setup
	$(BIN)/python tests/stress/stress.py $(ARGS)

hw-check: setup
	$(BIN)/python -m pytest -q -rs tests/hw

clean:
	rm -rf $(RUN) .bench .stress build dist *.egg-info agent/pb
