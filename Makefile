# dra-agent: `make run` starts the agent on an embedded default, `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RUN    ?= .run
PB     := agent/pb/__init__.py

.PHONY: all setup test test-cluster test-kubelet cluster-components kubelet-components lint run bench stress hw-check nvml-standin gocheck helm promtool clean

all: setup

# Quiet pip, so each step says what it does in one line (the first install downloads for a minute or so).
# agent/__init__.py holds the version: installed again when it changes, so the installed metadata
# (importlib.metadata, pip show) says the agent's version.
$(STAMP): pyproject.toml setup.py agent/__init__.py
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is needed"'
	@test -x $(BIN)/python || { echo "setup: making the virtual environment $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "setup: installing dra-agent and its dependencies into $(VENV) (pip; a minute or so the first time)"
	@$(BIN)/python -m pip install -q --upgrade pip
	@$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

$(PB): proto/*.proto proto/build.py $(STAMP)
	@echo "setup: generating the gRPC modules (agent/pb) from proto/"
	@$(BIN)/python proto/build.py >/dev/null

setup: $(STAMP) $(PB)

lint: setup
	$(BIN)/ruff check agent cdi tests bench examples proto image
	$(BIN)/mypy agent cdi
	MYPYPATH=bench:tests $(BIN)/mypy --explicit-package-bases bench/*.py

test: lint nvml-standin gocheck helm promtool cluster-components kubelet-components
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The Go checker (tests/gocheck): the official CDI and device-metadata libraries read what the agent
# writes (tests/test_official_readers.py), and the kubelet's registration calls over grpc-go
# (kubeletreg, tests/test_registration.py). Built once into ~/.cache/dra-agent/gocheck-<hash>/, reused
# while go.mod, go.sum, the sources and the Go toolchain stay the same. Without Go it only warns (the
# tests then skip), unless DRA_TEST_NO_SKIP is set.
gocheck:
	$(PYTHON) tests/gocheck/build.py >/dev/null

# promtool from Prometheus's Go module (tests/promtool), and promqlnames beside it: they check the alert
# rules of deploy/monitoring and the metrics they and the dashboard name (tests/test_monitoring.py).
# Built once into ~/.cache/dra-agent/promtool-<hash>/, as gocheck is.
promtool:
	$(PYTHON) tests/promtool/build.py >/dev/null

# Helm v4 from its Go module (tests/helm): lints, renders and installs deploy/helm/dra-agent
# (tests/test_helm.py, tests/cluster/test_cluster_helm.py). Built once into ~/.cache/dra-agent/helm-<hash>/,
# as gocheck is.
helm:
	$(PYTHON) tests/helm/build.py >/dev/null

# The real Kubernetes control plane the tests under tests/cluster run against (docs/tests.md):
# kube-apiserver, kube-scheduler, kube-controller-manager and etcd, built with Go from
# tests/cluster/k8s/go.mod into ~/.cache/dra-agent/k8s-<version>/, reused while go.mod, go.sum and
# the Go version stay the same. `make test-cluster` runs only those tests.
cluster-components: setup
	$(BIN)/python tests/cluster/build.py >/dev/null

test-cluster: cluster-components kubelet-components
	$(BIN)/python -m pytest -q -m cluster tests/cluster $(PYTEST_ARGS)

# A real node for the cluster tests (docs/tests.md, "A real kubelet"): the kubelet of the same release,
# containerd, ctr and containerd-shim-runc-v2, runc, and the CNI plugins of the pod network, built from
# tests/cluster/{kubelet,containerd,runc,cni} into ~/.cache/dra-agent/k8s-<version>/node/.
# `make test-kubelet` runs the real-node tests (as root: containerd, runc, mounts, the pods' bridge).
kubelet-components: setup
	$(BIN)/python tests/cluster/build.py --node >/dev/null

test-kubelet: cluster-components kubelet-components
	$(BIN)/python -m pytest -q -m kubelet tests/cluster $(PYTEST_ARGS)

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
# Metrics and probes on 127.0.0.1:9477, where `dra-agent doctor` looks by default (a port taken is retried in
# the background); DRA_METRICS_ADDRESS picks another, empty turns them off.
# The agent is make's own child (exec), and stops when make does, whatever signal stopped make.
run: setup
	$(BIN)/python examples/seed.py $(RUN)
	exec $(BIN)/dra-agent run --stop-with-parent true \
	  --nvml "$${DRA_NVML:-$$($(BIN)/python -m agent.inventory.gpus --probe)}" \
	  --offline-fallback $(RUN)/offline \
	  --kubelet-dir $(RUN)/kubelet --cdi-dir $(RUN)/cdi --static-cdi-dir $(RUN)/cdi-static \
	  --state-dir $(RUN)/state \
	  --metrics-address "$${DRA_METRICS_ADDRESS-127.0.0.1:9477}" $(ARGS)

bench: setup cluster-components
	$(BIN)/python bench/bench.py $(ARGS)

# The crash suite and the fuzzer (tests/stress/stress.py): >= 1,000 SIGKILLs, >= 10,000 inputs.
stress: setup
	$(BIN)/python tests/stress/stress.py $(ARGS)

hw-check: setup
	$(BIN)/python -m pytest -q -rs tests/hw

# The container image (Containerfile; docs/image.md): from a registry's Python base, the
# wheels from PyPI. IMAGE names it, IMAGE_BASE is the base.
IMAGE      ?= localhost/dra-agent:latest
IMAGE_BASE ?= docker.io/library/python:3.11-slim-bookworm
# The agent's version, from its one source (the image's labels; the build refuses another).
AGENT_VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' agent/__init__.py)

.PHONY: image image-offline release test-release
image:
	podman build --build-arg BASE=$(IMAGE_BASE) --build-arg VERSION=$(AGENT_VERSION) --tag $(IMAGE) --file Containerfile .

# The same image with no registry, as CI builds it (image/build.py): a Debian base made here by
# mmdebstrap, the wheels downloaded here into .image/wheels, and no network in the build.
image-offline: $(STAMP)
	$(BIN)/python image/build.py --tag $(IMAGE)

# A release (image/release.py; docs/image.md, "A release"): the image for linux/amd64 and linux/arm64 built
# as image-offline builds it (the arm64 one under qemu-user-static, binfmt_misc set up where it is not),
# one multi-arch OCI archive, and the Helm chart packaged, all of the agent's version, in dist/<version>/.
release: $(STAMP) helm
	$(BIN)/python image/release.py

# The release's test alone (tests/test_release.py; `make test` runs it with the rest).
test-release: setup helm
	$(BIN)/python -m pytest -q -m release tests/test_release.py $(PYTEST_ARGS)

clean:
	rm -rf $(RUN) .bench .stress build dist *.egg-info agent/pb $(STANDIN)
