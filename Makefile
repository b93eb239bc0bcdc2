# The two commands a newcomer runs: `make run` (the relay end to end, locally)
# and `make test` (everything CI checks). Both install what they need first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: run test lint typecheck pytest sam-check bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "Python 3.11 or newer is needed (found $$($(PYTHON) --version))"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

run: $(STAMP)
	$(BIN)/python -m outbox.local

test: lint typecheck pytest sam-check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest

sam-check: $(STAMP)
	@echo "sam validate --lint, sam build and the built-artifact test: see template work"

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) .aws-sam .tools .pytest_cache .mypy_cache .ruff_cache
