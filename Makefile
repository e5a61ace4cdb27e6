# The two commands README.md shows. Both set themselves up first (idempotent, seconds when done).
VENV ?= .venv
export VENV

.PHONY: setup test unit lint format demo clean

setup:
	@bash scripts/setup.sh

# Everything CI runs: the formatter check, ruff's lint rules, the type checker, the import-layering contracts (pyproject.toml), every test tier.
# Two pytest-xdist workers, each file in one of them (tests/conftest.py: SHARED_SCENARIOS).
test: setup lint
	$(VENV)/bin/python -m pytest -q -ra -n 2 --dist loadgroup --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

# The fast tier alone (pure functions, no Ray, vLLM or GPU): well under a minute.
unit: setup
	$(VENV)/bin/python -m pytest -q -m unit $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check --quiet peagle_ray tests jobs scripts
	$(VENV)/bin/ruff check --quiet peagle_ray tests jobs scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: setup
	$(VENV)/bin/ruff format peagle_ray tests jobs scripts

demo: setup
	$(VENV)/bin/peagle-ray demo --config configs/demo.yaml $(DEMO_ARGS)

clean:
	rm -rf runs .pytest_cache
