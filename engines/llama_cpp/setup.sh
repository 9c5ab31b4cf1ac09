#!/usr/bin/env bash
# Install llama-cpp-python 0.3.36 (with its OpenAI server) and the gguf package into their own cached
# virtualenv (never into verinfer's environment): llama-cpp-python-0.3.36 under the engines cache
# (engines/venv.sh). llama.cpp is compiled from the sdist: the library only (no multimodal tools,
# examples, tests or llama.cpp's own server), measured 209 s on the idle 2-core machine (the full
# build with the multimodal tools took 67 min under load). Reused when complete. Prints the venv
# path; pip's output goes to stderr.
set -euo pipefail
VERSION=0.3.36
source "$(dirname "$0")/../venv.sh"
engine_venv "llama-cpp-python-$VERSION" llama_cpp gguf
CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 "$VENV/bin/pip" install -q "llama-cpp-python[server]==$VERSION" >&2
# engines/llama_cpp/f32_gguf.py reads and writes GGUF files with it
"$VENV/bin/pip" install -q gguf >&2
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server, gguf; print('llama_cpp', llama_cpp.__version__)" >&2
engine_done
