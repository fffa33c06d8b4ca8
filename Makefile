# The README's two commands. Both install what is missing first (Debian, as root), then run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml lab/pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) bash scripts/setup.sh
	touch $(STAMP)

demo: setup
	$(PY) -m agent demo

# Four test processes on two cores, one per test file (`--dist loadfile`: a file's fixtures are
# built once): most of the suite waits on real brokers, agents, containers and timers, not on the
# CPU (three left the cores a quarter idle: docs/results.md, O55).
TEST_PROCESSES ?= 4

test: setup
	$(PY) -m pytest -n $(TEST_PROCESSES) --dist loadfile

bench: setup
	$(PY) -m agent bench sim
	$(PY) -m agent bench dataplane --json

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
