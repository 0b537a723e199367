# Two commands on a fresh machine: `make run` (set up on first use, then the main demo) and
# `make test` (set up on first use, then the quick test tier on two pytest-xdist workers, one per core here).
# `make test-all` is the full suite (CI runs it): the quick tier on two workers, then the real-process tier serially
# (its swarms time heartbeats and calls; two at once on 2 cores would make those flaky); `make docs` builds the site
# (--strict: a broken link or a missing page fails). All create and reuse .venv; the plain pip commands in the
# README are for those who manage their own environment.
PYTHON ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
# pytest exits 5 when it collected no tests: a tier that ran nothing fails.
PYTEST = $(BIN)/python -m pytest $(1) $(ARGS); code=$$?; \
	if [ $$code -eq 5 ]; then echo "make: pytest collected no tests: failing" >&2; exit 1; fi; exit $$code

# The project's own modules byte-compiled before a test tier: where PYTHONDONTWRITEBYTECODE is set (as in this
# machine's environment) nothing writes their .pyc, and every process the real-process tier starts compiled them
# from source again (0.15-0.3 s of its start). A .pyc older than its source is not used.
COMPILE = $(BIN)/python -m compileall -q checkfree peers coordinator swarm faults ops harness experiments benchmarks cli dst

.PHONY: run test test-all docs setup clean-venv

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0 -e '.[dev]'
	touch $@

$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/python -m pip install -e '.[docs]'
	touch $@

run: setup
	$(BIN)/checkfree local --preset tiny --strategy checkfree+ $(ARGS)

test: setup
	$(COMPILE)
	$(call PYTEST,--quick -n 2 --dist worksteal)

test-all: setup
	$(COMPILE)
	$(call PYTEST,--quick -n 2 --dist worksteal)
	$(call PYTEST,--real)

docs: $(VENV)/.docs-installed
	$(BIN)/python -m mkdocs build --strict

clean-venv:
	rm -rf $(VENV)
