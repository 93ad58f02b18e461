# Two commands on a fresh machine: `make demo` and `make test`; each bootstraps .venv.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.fedseg-installed
# torch is pinned in the same pip command as MONAI and everything that depends on
# torch; otherwise pip resolves a multi-GB CUDA build.
TORCH  := torch==2.13.0

.PHONY: demo test test-fast lint typecheck format venv bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check "$(TORCH)" -e ".[dev,deploy,report,privacy,prepare,track,export,cluster]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedseg demo

# every tier (tests/unit, tests/runs, tests/deploy; tests/conftest.py), one pytest worker per core (at most 4;
# pytest-xdist): the tests use one torch thread each, and the deployment tests mostly wait on their FLARE
# processes.  --dist loadgroup: the tests that start FLARE are one group (tests/conftest.py), the every-method
# comparisons that share their simulations another; each group runs on one worker, the largest first, and the
# other tests go one at a time to whichever worker is free
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist loadgroup --durations=15

# the unit tier only: the same without the tests marked slow (tests/runs, tests/deploy)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --maxprocesses=4 --dist loadgroup --durations=15 -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

# mypy over src/fedseg (configured in pyproject.toml, [tool.mypy])
typecheck: $(STAMP)
	$(BIN)/python -m mypy

format: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
