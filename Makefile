# Two commands do everything on a fresh machine:
#   make demo   - set up and run the main job on the bundled example
#   make test   - set up and run lint, types, layer contracts and the tests
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test lint typecheck contracts pytest bench clean setup

$(STAMP): pyproject.toml deploy/install-servers.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e '.[dev,deepspeed]'
	bash deploy/install-servers.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/sailor demo

lint: $(STAMP)
	$(BIN)/ruff check sailor tests benchmarks
	$(BIN)/ruff format --check sailor tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy sailor

contracts: $(STAMP)
	$(BIN)/lint-imports

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck contracts pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/simulator_accuracy.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
