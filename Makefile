# The two commands README.md shows. Both set themselves up first (idempotent, seconds when done).
VENV ?= .venv
export VENV

.PHONY: setup test demo clean

setup:
	@bash scripts/setup.sh

test: setup
	$(VENV)/bin/python -m pytest -q -ra $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/peagle-ray demo --config configs/demo.yaml $(DEMO_ARGS)

clean:
	rm -rf runs .pytest_cache
