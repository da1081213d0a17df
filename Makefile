# Two commands for a newcomer: `make lab` and `make test`. Both set everything up.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LAB_ARGS ?=
# Per-cell timeout (seconds) for notebooks under nbval.
CELL_TIMEOUT ?= 300

.PHONY: lab test lint unit notebooks e2e bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Reinstall only when the dependency list or the pins change.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,dask,e2e]"
	touch $(STAMP)

# JupyterLab refuses to run as root unless told: containers often are root.
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $(ROOT_ARGS) $(LAB_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check batchsim tests bench e2e

unit: $(STAMP)
	BATCHSIM_QUICK=1 MPLBACKEND=Agg $(BIN)/python -m pytest -q tests

notebooks: $(STAMP)
	BATCHSIM_QUICK=1 MPLBACKEND=Agg $(BIN)/python -m pytest -q -p no:cacheprovider \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=$(CELL_TIMEOUT) notebooks

test: lint unit notebooks

# A real browser: Debian's Chromium (installed if absent) driven by Playwright.
e2e: $(STAMP)
	test -x /usr/bin/chromium || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	timeout 300 $(BIN)/python -m pytest -q -p no:cacheprovider e2e

bench: $(STAMP)
	for f in bench/bench_*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
