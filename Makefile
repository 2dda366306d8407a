# make demo: the main job; make test: the linters, then the test suite. Both install what they
# need first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flowtrain-setup

.PHONY: setup lint test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

lint: setup
	$(PY) -m ruff check flowtrain sims tui cuda_numba tests benchmarks examples
	$(PY) -m mypy flowtrain cuda_numba sims tui

test: lint
	$(PY) -m pytest -q

demo: setup
	VENV=$(VENV) bash scripts/demo.sh

bench: setup
	$(PY) benchmarks/actor_latency.py

clean:
	rm -rf runs .pytest_cache
