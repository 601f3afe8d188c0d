# Two commands on a fresh clone: `make serve` runs the service on an embedded
# SQLite file, `make test` runs the test suite. Both create .venv on first use
# and install what they need into it: `serve` only the two packages and their
# runtime dependencies, `test` the test extras on top (torch, TRL, ...), `lint`
# the linters. Each layer has a stamp file, remade when a pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PYPROJECTS := pyproject.toml clients/python/pyproject.toml
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test
LINT_STAMP := $(VENV)/.installed-lint
# No --quiet: pip's "Collecting ..." lines are the progress of a first install.
# --no-compile: byte-compiling every installed module (torch, transformers)
# took longer than the rest of the test layer's install; Python compiles what
# is imported, when it is first imported.
PIP_INSTALL := $(BIN)/python -m pip install --disable-pip-version-check --no-compile
# The test layer and the framework environments are installed by uv, which
# pip puts into .venv first: uv fetches in parallel and links from its cache,
# where pip took 40-50 s an environment and most of a core (measured on this
# 2-core machine, 2026-11-27). uv reads no pip configuration, so pip's
# find-links (PIP_FIND_LINKS, else pip.conf's: where a machine keeps its CPU
# build of torch) are passed on; uv does not byte-compile, like --no-compile.
UV_VERSION := 0.13.9
UV := $(BIN)/uv
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(UV) pip install $(foreach links,$(FIND_LINKS),--find-links $(links)) --python

# Let Python keep the bytecode it compiles (some machines set
# PYTHONDONTWRITEBYTECODE=1, this one included): the tests start hundreds of
# Python processes (servers, Ray workers), and each would otherwise compile
# torch, transformers and the server from source again. The OpenRLHF tests
# took 253 s that way and 115 s with it cached (2026-11-27, 2 cores).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: serve test test-quick test-under-load test-frameworks lint tools proto bench simulate soak dev-image image-lock clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || \
	  { echo "Python >= 3.11 is needed: '$(PYTHON)' is $$($(PYTHON) --version 2>&1); run make PYTHON=python3.11 ..."; exit 1; }
	@echo "== creating $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)

$(RUNTIME_STAMP): $(PYPROJECTS) | $(BIN)/python
	@echo "== installing the server and the client, runtime dependencies only, into $(VENV)"
	$(PIP_INSTALL) -e clients/python -e .
	@touch $@

$(TEST_STAMP): $(RUNTIME_STAMP) $(PYPROJECTS)
	@echo "== installing the test extras (pytest, grpcio-tools, torch CPU, TRL, ...) into $(VENV)"
	$(PIP_INSTALL) uv==$(UV_VERSION)
	$(UV_INSTALL) $(BIN)/python -e clients/python -e '.[test]'
	@touch $@

$(LINT_STAMP): $(RUNTIME_STAMP) $(PYPROJECTS)
	@echo "== installing the linters (ruff, mypy, type stubs) into $(VENV)"
	$(PIP_INSTALL) -e clients/python -e '.[lint]'
	@touch $@

serve: $(RUNTIME_STAMP)
	@echo "== bots-server serve (settings: bots-server serve --help, or the BOTS_* variables in docs/operations.md)"
	$(BIN)/bots-server serve

# pytest-xdist workers; 0 runs in one process. The suite mostly waits on
# server processes (starts, restarts, kills), so two workers on two cores take
# about two thirds of the time of one; four were no faster (each test ran
# slower). --dist loadfile keeps a file on one worker, so its module-scoped
# servers (Prometheus, the auth server) start once per run.
PYTEST_WORKERS ?= 2

test: $(TEST_STAMP) tools
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=20 $(PYTEST_ARGS)

# The edit-test loop: the engine, core, store, client and API tests on SQLite
# only (the PostgreSQL parameters deselected by name), no frameworks, no
# benchmarks, no fault injection. `make test` before a push.
QUICK_TESTS := tests/engine tests/core tests/store tests/api tests/client
test-quick: $(TEST_STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile -q -k "not postgresql" $(QUICK_TESTS) $(PYTEST_ARGS)

# The suite beside a CPU hog (three busy processes a core: load 6+ on two
# cores), RUNS times in a row; prints the load it ran under.
test-under-load: $(TEST_STAMP) tools
	$(BIN)/python scripts/test_under_load.py --runs $(or $(RUNS),1) -- \
	  $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=20 $(PYTEST_ARGS)

# The real verl and Trinity-RFT adapter tests, in an environment of their
# own: verl 0.7.x pins numpy < 2, which the main environment (numpy 2)
# cannot take. Exact pins (tests/integrations/frameworks-constraints.txt)
# keep the install fast and repeatable; under CI a missing framework fails
# instead of skipping. cachetools: verl's agent loop imports it but verl does
# not require it (vLLM brings it on GPU machines). .ci/run runs it after `make test`.
FRAMEWORKS_VENV := .venv-frameworks
FRAMEWORKS_CONSTRAINTS := tests/integrations/frameworks-constraints.txt
FRAMEWORKS_STAMP := $(FRAMEWORKS_VENV)/.installed

$(FRAMEWORKS_STAMP): $(PYPROJECTS) $(FRAMEWORKS_CONSTRAINTS) | $(TEST_STAMP)
	@echo "== installing verl 0.7.1 and trinity-rft 0.6.0 (numpy < 2) into $(FRAMEWORKS_VENV)"
	$(UV) venv --allow-existing --python $(PYTHON) $(FRAMEWORKS_VENV)
	$(UV_INSTALL) $(FRAMEWORKS_VENV)/bin/python \
	  -c $(FRAMEWORKS_CONSTRAINTS) verl==0.7.1 trinity-rft==0.6.0 greenlet pytest pytest-asyncio \
	  torchdata tensorboard cachetools -e clients/python -e .
	@touch $@

# verl 0.9 (the data.custom_cls adapter) in a third environment: it needs
# numpy >= 2 and caps transformers below the version the main environment's
# TRL runs on.
VERL09_VENV := .venv-verl09
VERL09_CONSTRAINTS := tests/integrations/verl09-constraints.txt
VERL09_STAMP := $(VERL09_VENV)/.installed

$(VERL09_STAMP): $(PYPROJECTS) $(VERL09_CONSTRAINTS) | $(TEST_STAMP)
	@echo "== installing verl 0.9.1 (v1 trainer, TransferQueue) into $(VERL09_VENV)"
	$(UV) venv --allow-existing --python $(PYTHON) $(VERL09_VENV)
	$(UV_INSTALL) $(VERL09_VENV)/bin/python \
	  -c $(VERL09_CONSTRAINTS) 'verl[verl-core]==0.9.1' greenlet pytest pytest-asyncio \
	  torchdata tensorboard cachetools -e clients/python -e .
	@touch $@

# OpenRLHF 0.11 in a fourth: it pins transformers 5.15, ray 2.55 and
# deepspeed 0.19.6. openrlhf goes in without its dependencies (it requires
# flash-attn, a CUDA build; the tests stand in for it and for vLLM), the
# rest from exact pins.
OPENRLHF_VENV := .venv-openrlhf
OPENRLHF_CONSTRAINTS := tests/integrations/openrlhf-constraints.txt
OPENRLHF_STAMP := $(OPENRLHF_VENV)/.installed

$(OPENRLHF_STAMP): $(PYPROJECTS) $(OPENRLHF_CONSTRAINTS) | $(TEST_STAMP)
	@echo "== installing OpenRLHF 0.11.2 (ray, deepspeed, transformers 5.15) into $(OPENRLHF_VENV)"
	$(UV) venv --allow-existing --python $(PYTHON) $(OPENRLHF_VENV)
	DS_BUILD_OPS=0 $(UV_INSTALL) $(OPENRLHF_VENV)/bin/python \
	  -c $(OPENRLHF_CONSTRAINTS) -r $(OPENRLHF_CONSTRAINTS) greenlet pytest pytest-asyncio \
	  -e clients/python -e .
	$(UV_INSTALL) $(OPENRLHF_VENV)/bin/python --no-deps openrlhf==0.11.2
	@touch $@

# SkyRL 0.3 in a fifth: it pins ray 2.56 and transformers 5.6-5.8. skyrl and
# skyrl-gym go in without their dependencies (the skyrl-train extra requires
# flash-attn and vllm-router, CUDA builds), the rest from exact pins.
SKYRL_VENV := .venv-skyrl
SKYRL_CONSTRAINTS := tests/integrations/skyrl-constraints.txt
SKYRL_STAMP := $(SKYRL_VENV)/.installed

$(SKYRL_STAMP): $(PYPROJECTS) $(SKYRL_CONSTRAINTS) | $(TEST_STAMP)
	@echo "== installing SkyRL 0.3.0 (ray 2.56, transformers 5.8) into $(SKYRL_VENV)"
	$(UV) venv --allow-existing --python $(PYTHON) $(SKYRL_VENV)
	$(UV_INSTALL) $(SKYRL_VENV)/bin/python \
	  -c $(SKYRL_CONSTRAINTS) -r $(SKYRL_CONSTRAINTS) greenlet pytest pytest-asyncio \
	  -e clients/python -e .
	$(UV_INSTALL) $(SKYRL_VENV)/bin/python --no-deps skyrl==0.3.0 skyrl-gym==0.4.0
	@touch $@

test-frameworks: $(FRAMEWORKS_STAMP) $(VERL09_STAMP) $(OPENRLHF_STAMP) $(SKYRL_STAMP)
	BOTS_EXPECT_VERL=1 BOTS_TEST_REQUIRED_FRAMEWORKS=verl,trinity,torch,torchdata,tensorboard \
	  $(FRAMEWORKS_VENV)/bin/python -m pytest -p no:cacheprovider \
	  tests/integrations/test_verl.py tests/integrations/test_trinity.py
	BOTS_TEST_REQUIRED_FRAMEWORKS=verl,ray,transfer_queue,torch,torchdata,tensorboard \
	  $(VERL09_VENV)/bin/python -m pytest -p no:cacheprovider tests/integrations/test_verl_dataset.py
	BOTS_TEST_REQUIRED_FRAMEWORKS=openrlhf,ray,tensorboard \
	  $(OPENRLHF_VENV)/bin/python -m pytest -p no:cacheprovider tests/integrations/test_openrlhf.py
	BOTS_TEST_REQUIRED_FRAMEWORKS=skyrl,typing_extensions \
	  $(SKYRL_VENV)/bin/python -m pytest -p no:cacheprovider tests/integrations/test_skyrl.py

# The lint gate (.ci/run runs it before the tests). No `ruff format --check`:
# the tree is not formatted that way.
lint: $(LINT_STAMP)
	@status=0; \
	echo "== ruff check ."; $(BIN)/ruff check . || status=1; \
	echo "== mypy (files and settings: [tool.mypy] in pyproject.toml)"; $(BIN)/mypy || status=1; \
	exit $$status

# promtool and prometheus, for the operations tests (tests/ops): Debian's
# `prometheus` package, installed only when missing and only as root
# (RUNLEVEL=1: do not start the packaged daemon). Without them those tests
# skip, except under CI, where they fail. kubectl (for `kubectl kustomize`)
# must already be on PATH: Debian's is too old for kustomize components.
tools:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "== installing Debian's prometheus package (promtool, prometheus)"; \
	    apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else \
	    echo "promtool/prometheus not found: install Debian's prometheus package to run all of tests/ops"; \
	  fi; \
	fi

proto: $(TEST_STAMP)
	$(BIN)/python scripts/gen_proto.py

# Benchmarks (docs/benchmarks.md): speed and scale; data efficiency.
bench: $(TEST_STAMP)
	$(BIN)/python -m bench.perf

simulate: $(TEST_STAMP)
	$(BIN)/python -m bench.simulate

# Crash soak (docs/design.md): SOAK_KILLS random SIGKILLs of a server under a
# trainer, alternating SQLite and PostgreSQL, within SOAK_MINUTES; fails on any
# lost, doubled or diverging outcome.
soak: $(TEST_STAMP)
	$(BIN)/python scripts/soak.py --kills $(or $(SOAK_KILLS),1000) --minutes $(or $(SOAK_MINUTES),90)

# The container image's lock file (deploy/image/requirements.txt, hashed
# pins of every third-party package; the Dockerfile installs from it). Run it
# after changing a dependency in a pyproject.toml, with Python 3.11 (the
# image's): pip-compile resolves markers for the Python that runs it.
image-lock: $(RUNTIME_STAMP)
	$(PIP_INSTALL) pip-tools==7.6.2
	$(BIN)/python scripts/lock_image.py

# The image the dev overlay (deploy/k8s/overlays/dev) runs: built here and
# loaded into the cluster's nodes, since nothing pushes it to a registry.
# DEV_CLUSTER=kind (default; KIND_CLUSTER names the cluster) or minikube.
# The overlay never pulls it (imagePullPolicy: Never), so a pod on a node
# without it fails with ErrImageNeverPull instead of pulling another image.
DEV_IMAGE := bots-server:dev
DEV_CLUSTER ?= kind
KIND_CLUSTER ?= kind

dev-image:
	docker build --tag $(DEV_IMAGE) .
ifeq ($(DEV_CLUSTER),minikube)
	minikube image load $(DEV_IMAGE)
else ifeq ($(DEV_CLUSTER),kind)
	kind load docker-image $(DEV_IMAGE) --name $(KIND_CLUSTER)
else
	$(error DEV_CLUSTER must be kind or minikube, not '$(DEV_CLUSTER)')
endif

clean:
	rm -rf $(VENV) $(FRAMEWORKS_VENV) $(VERL09_VENV) $(OPENRLHF_VENV) $(SKYRL_VENV)
