# Two entry points: `make demo` (the main job on the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# verl 0.9 pins transformers < 5.11, so its tests run in their own environment: CPU torch first, then verl
# with its pins, then bitrl without touching torch.
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
$(VERL_STAMP): pyproject.toml
	test -x $(VERL_VENV)/bin/python || $(PY) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(VERL_VENV)/bin/pip install -q torch==2.13.0
	$(VERL_VENV)/bin/pip install -q verl==0.9.1
	$(VERL_VENV)/bin/pip install -q -e '.[dev]' 'torch==2.13.0'
	touch $(VERL_STAMP)

demo: $(STAMP)
	$(BIN)/bitrl train

test: $(STAMP)
	$(BIN)/ruff check .
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q
	$(MAKE) $(VERL_STAMP) && $(VERL_VENV)/bin/python -m pytest -q tests/test_integrations_verl.py

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m pytest benchmarks -q --benchmark-only

clean:
	rm -rf $(VENV) $(VERL_VENV) build *.egg-info runs
