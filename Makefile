# WeEnv developer entry points. Everything installs through scripts/setup.sh (idempotent).
SHELL := /bin/bash
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test-setup bench-setup demo test lint bench

setup:
	bash scripts/setup.sh

# The tests add the lazy-pulling peer (its smoke test is part of the suite).
test-setup:
	bash scripts/setup.sh --test

demo: setup
	$(BIN)/weenv demo

lint: setup
	$(BIN)/ruff check .

test: test-setup
	$(BIN)/ruff check .
	$(BIN)/pytest

# What only the benchmarks add: matplotlib for their figures (Debian packages are all in setup).
bench-setup:
	bash scripts/setup.sh --bench

# Runs every benchmark in its quick mode; each script prints its own numbers.
bench: bench-setup
	@shopt -s nullglob; scripts=(benchmarks/*.py); \
	if (( $${#scripts[@]} == 0 )); then echo "no benchmarks in benchmarks/"; exit 0; fi; \
	for script in "$${scripts[@]}"; do \
		echo "== $$script --quick"; $(BIN)/python "$$script" --quick || exit $$?; \
	done
