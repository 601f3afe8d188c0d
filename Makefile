# Two commands on a fresh clone: `make serve` runs the service on an embedded
# SQLite file, `make test` runs the test suite. Both create .venv and install
# what they need on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test tools proto bench simulate soak clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e clients/python -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/bots-server serve

test: $(STAMP) tools
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# promtool and prometheus, for the operations tests (tests/ops): Debian's
# `prometheus` package, installed only when missing and only as root
# (RUNLEVEL=1: do not start the packaged daemon). Without them those tests
# skip, except under CI, where they fail. kubectl (for `kubectl kustomize`)
# must already be on PATH: Debian's is too old for kustomize components.
tools:
	@if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's prometheus package (promtool, prometheus)"; \
	    apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else \
	    echo "promtool/prometheus not found: install Debian's prometheus package to run all of tests/ops"; \
	  fi; \
	fi

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

# Benchmarks (docs/benchmarks.md): speed and scale; data efficiency.
bench: $(STAMP)
	$(BIN)/python -m bench.perf

simulate: $(STAMP)
	$(BIN)/python -m bench.simulate

# Crash soak (docs/design.md): random SIGKILLs for SOAK_MINUTES.
soak: $(STAMP)
	$(BIN)/python scripts/soak.py --minutes $(or $(SOAK_MINUTES),10)

clean:
	rm -rf $(VENV)
