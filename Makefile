# Two commands do everything on a fresh machine:
#   make demo   - set up and run the main job on the bundled example
#   make test   - set up and run lint, types, layer contracts and the tests
#   make chaos  - every chaos scenario (tests/chaos, docs/chaos.md) and their table
#   make long-test - the tests make test leaves out (marked long; scaffolding, repeats)
#   make gpu-test - the GPU tests (tests/gpu, docs/gpu.md); each skips with its reason without CUDA
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test lint typecheck typecheck-beside contracts pytest bench chaos long-test gpu-test clean setup

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

# Three pytest workers (pytest-xdist), a test file per worker at a time: most integration tests
# wait on servers, leases and paced steps (two workers kept the two cores of the machines here
# ~60 % busy, CPU seconds over wall), so three at once use them; TEST_WORKERS=0 runs them one
# by one.
TEST_WORKERS ?= 3
pytest: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

# mypy runs beside the tests at low priority: on a fresh clone (no cache) it takes ~70 s of
# one core, which the tests, waiting on servers and paced steps, leave idle at times.
test: lint contracts
	$(MAKE) --no-print-directory -j2 typecheck-beside pytest

typecheck-beside: $(STAMP)
	nice -n 10 $(BIN)/mypy sailor

# All chaos scenarios (make test runs the CI subset); the table is printed at the end.
chaos: $(STAMP)
	@echo "chaos: $$(date -u +%FT%TZ), $$(nproc) cores, load average $$(cut -d' ' -f1-3 /proc/loadavg)"
	t=$$(mktemp /tmp/sailor-chaos-XXXXXX.jsonl); \
		SAILOR_CHAOS=all SAILOR_CHAOS_TABLE=$$t $(BIN)/pytest -q tests/chaos; rc=$$?; \
		rm -f $$t; \
		echo "chaos: done $$(date -u +%FT%TZ), load average $$(cut -d' ' -f1-3 /proc/loadavg)"; \
		exit $$rc

# The tests marked long (tests/conftest.py): CPU host-sharing scaffolding, further random
# crash points, layouts another test of make test already covers.
long-test: $(STAMP)
	SAILOR_LONG=1 $(BIN)/pytest -q -m long

# On a GPU host: the NCCL, CUDA and bf16 paths (tests/gpu); here every test skips with its reason.
gpu-test: $(STAMP)
	$(BIN)/pytest -q -rs tests/gpu

bench: $(STAMP)
	$(BIN)/python benchmarks/simulator_accuracy.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
