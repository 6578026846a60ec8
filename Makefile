# The two commands of the README. Both work on a fresh machine: they create
# .venv, install unbroken (torch 2.13.0 comes from the local CPU wheel) and run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: demo test install clean

demo: $(STAMP)
	$(BIN)/unbroken demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q tests

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

clean:
	rm -rf $(VENV) .unbroken .unbroken-demo .pytest_cache
