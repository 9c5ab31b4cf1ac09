#!/usr/bin/env bash
# llama-cpp-python 0.3.36 in its own venv; it compiles llama.cpp from source (measured here: libllama
# linked after 26 min, the whole install, with the multimodal tools, 4,004 s at load ~11 on 2 cores).
set -euo pipefail
V=${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines/llama-cpp-python-0.3.36
python -m venv "$V"
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$V/bin/pip" install -v llama-cpp-python==0.3.36
echo "$V/bin/python engines/llama_cpp/generate.py run --prompts PROMPTS.json --out RAW.json"
