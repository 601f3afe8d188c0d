# Two commands on a fresh clone: `make serve` runs the service on an embedded
# SQLite file, `make test` runs the test suite. Both create .venv and install
# what they need on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test proto bench clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -e clients/python -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/bots-server serve

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV)
