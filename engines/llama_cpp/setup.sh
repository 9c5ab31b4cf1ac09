#!/usr/bin/env bash
# Install llama-cpp-python 0.3.36 (with its OpenAI server) and the gguf package into their own cached
# virtualenv (never into verinfer's environment):
#   ${VERINFER_ENGINES:-${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines}/llama-cpp-python-0.3.36
# llama.cpp is compiled from the sdist: the library only (no multimodal tools, examples, tests or
# llama.cpp's own server), measured 209 s on the idle 2-core machine (the full build with the
# multimodal tools took 67 min under load). Reused when present (a marker file is written only
# after a complete install). Prints the venv path; pip's output goes to stderr.
set -euo pipefail
VERSION=0.3.36
ENGINES="${VERINFER_ENGINES:-${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines}"
VENV="$ENGINES/llama-cpp-python-$VERSION"
MARK="$VENV/.verinfer-complete"
PY="${PYTHON:-python3}"
# Reuse: the marker (written last) and both packages in place; not importing llama_cpp keeps this instant.
if [ -f "$MARK" ] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('llama_cpp', 'gguf')))" 2>/dev/null; then
  echo "$VENV"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/pip" install -q --upgrade pip >&2
CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=2 "$VENV/bin/pip" install -q "llama-cpp-python[server]==$VERSION" >&2
# engines/llama_cpp/f32_gguf.py reads and writes GGUF files with it
"$VENV/bin/pip" install -q gguf >&2
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server, gguf; print('llama_cpp', llama_cpp.__version__)" >&2
echo "install_seconds=$(( $(date +%s) - start ))" > "$MARK"
cat "$MARK" >&2
echo "$VENV"
