# The two commands of the README. Both work on a fresh machine: they create
# .venv, install unbroken and run.
#
# torch: on a machine without an NVIDIA driver the CPU build is installed first
# (`torch==2.13.0+cpu`: the local wheel where pip's find-links has it, else
# PyTorch's CPU index), so that pyproject's library-style range is already
# satisfied and pip never pulls the ~4 GB CUDA build and its nvidia-* packages.
# Where neither has it (PyTorch's index unreachable, no local wheel), the
# registry's build of the same version goes in: large, but it runs on a CPU.
# With a driver, the registry's default (CUDA) build is installed. A torch the
# user installed into .venv themselves is never replaced.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)

TORCH_VERSION   ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_NVIDIA      := $(shell test -e /proc/driver/nvidia/version && echo yes)
TORCH_SPEC      := torch==$(TORCH_VERSION)$(if $(HAS_NVIDIA),,+cpu)

# What the tests run for real besides Python: Prometheus (scraping the cluster's /metrics),
# Chromium (the dashboard, driven by Playwright), the King James Bible (bible-kjv: a
# public-domain text the LLM workload's tests tokenize and train on), and for the real nodes
# (tests/controlplane/node.py) runc, the CNI plugins and mmdebstrap (the nodes' image from
# Debian's packages). Debian's packages; sudo where not root.
SYSTEM_PACKAGES := prometheus chromium bible-kjv bible-kjv-text kubectl runc containernetworking-plugins mmdebstrap
SUDO := $(shell test "$$(id -u)" = 0 || echo sudo)

# The suite in two runs: the fast part (unit tests, no cluster) on both cores with pytest-xdist
# (1 min 40 s instead of 2 min 50 s here), then the end-to-end tests one at a time: each runs a
# cluster of processes whose timeouts assume the machine is not shared with a second one.

.PHONY: demo test install system-packages control-plane screenshots clean

demo: $(STAMP)
	$(BIN)/unbroken demo

test: $(STAMP) system-packages control-plane
	$(BIN)/ruff check src tests benchmarks docs
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 -m "not slow" tests
	$(BIN)/python -m pytest -q --durations=40 -m slow tests

install: $(STAMP)

# The Kubernetes tests' control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# training-operator, JobSet, Trainer, Kueue) and the real nodes' kubelet, containerd and image tools, built
# from Go modules into ~/.cache/unbroken/control-plane/ once per version (tests/controlplane/build.py;
# ~13 min the first time here with the real nodes' components, nothing after that).
# Needs Go >= 1.24 (`go`, or /usr/local/go/bin/go) and its module proxy; Debian's golang-go is too old.
control-plane:
	$(PYTHON) tests/controlplane/build.py

# docs/img/dashboard-*.png: a real cluster through a fault, photographed in Chromium (a minute).
screenshots: $(STAMP) system-packages
	$(BIN)/python docs/screenshots.py

system-packages:
	@command -v prometheus >/dev/null && command -v chromium >/dev/null && command -v bible >/dev/null && command -v kubectl >/dev/null \
		&& test -x /usr/sbin/runc && test -x /usr/lib/cni/bridge && command -v mmdebstrap >/dev/null || \
		( $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES) )

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_SPEC)" \
		|| $(BIN)/pip install -q --retries 1 --timeout 15 "$(TORCH_SPEC)" --extra-index-url $(TORCH_CPU_INDEX) \
		|| $(BIN)/pip install -q "torch==$(TORCH_VERSION)"
	$(BIN)/pip install -q -e '.[test,bench]'
	rm -f $(VENV)/.installed-*
	touch $@

clean:
	rm -rf $(VENV) .unbroken .unbroken-demo .pytest_cache
