# The two commands from the README, and the pieces CI runs.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: setup run test test-gpu lint bench

# Create the virtual environment. torch is installed only when missing, pinned to 2.13.0 then
# (a CPU wheel where one is available locally; elsewhere the normal build), so a GPU user's own
# torch is kept. The package itself asks only for torch>=2.4. pip compiles what it installs one
# file at a time; compileall on every core does it in half the time (42 s for the whole set-up
# here instead of 58 s). As with pip, a file of another Python version is left uncompiled.
setup: $(BIN)/autotune

$(BIN)/autotune: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null \
		|| $(BIN)/python -m pip install -q --no-compile torch==2.13.0
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]"
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c \
		'import sysconfig; print(sysconfig.get_path("purelib"))')" > /dev/null || true
	touch $@

run: setup
	$(BIN)/autotune run --model bert

lint: setup
	$(BIN)/ruff check autotune objectives tests benchmarks examples
	$(BIN)/mypy autotune
	$(BIN)/lint-imports --no-cache

# Two test runs: most tests three at a time (on a 2-core machine too: tests wait on processes
# starting, ranks meeting and timeouts, and a third keeps the cores busy meanwhile), then the few
# `serial` ones alone, whose wall-time bounds need the machine to themselves. Both always run,
# and share one probe cache (the machine is probed once). The slowest tests are listed at the
# end: CI's goal is 10 minutes.
test: setup lint
	rc=0; export AUTOTUNE_CACHE_DIR="$${AUTOTUNE_CACHE_DIR:-$$(mktemp -d)}"; \
	$(BIN)/python -m pytest -q -n 3 --dist worksteal --durations=15 \
		-m "not gpu and not multi_gpu and not serial" || rc=$$?; \
	$(BIN)/python -m pytest -q -m "serial and not gpu and not multi_gpu" || rc=$$?; \
	exit $$rc

# On a machine with CUDA GPUs (scripts/gpu_check.sh runs this too).
test-gpu: setup
	$(BIN)/python -m pytest -q -m "gpu or multi_gpu"

# The search benchmark: every strategy replayed against the grids measured on this project's CPU
# (benchmarks/data/); seconds. `python benchmarks/search_efficiency.py measure --workload W`
# measures a grid on your machine first.
bench: setup
	$(BIN)/python benchmarks/search_efficiency.py replay
	$(BIN)/python benchmarks/slow_replay.py
