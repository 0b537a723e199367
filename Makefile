# Two commands on a fresh machine: `make run` (set up on first use, then the main demo) and
# `make test` (set up on first use, then the test suite). Both create and reuse .venv; the plain pip
# commands in the README are for those who manage their own environment.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin

.PHONY: run test setup clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0 -e '.[dev]'
	touch $@

run: setup
	$(BIN)/checkfree local --preset tiny --strategy checkfree+ $(ARGS)

test: setup
	$(BIN)/python -m pytest $(ARGS); code=$$?; \
	if [ $$code -eq 5 ]; then echo "make test: pytest collected no tests: failing" >&2; exit 1; fi; exit $$code

clean-venv:
	rm -rf $(VENV)
