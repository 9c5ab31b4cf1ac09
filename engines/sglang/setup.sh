#!/usr/bin/env bash
# A venv to run SGLang's own sampler code on CPU for golden vectors (engines/sglang/golden.py).
# SGLang needs a CUDA GPU to serve; its hash is a Triton kernel, which Triton's interpreter runs on
# CPU. The venv sees the main environment's torch 2.13.0 (no second torch download).
set -euo pipefail
V=${VERINFER_ENGINES:-${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines}/sglang-0.5.23
python -m venv --system-site-packages "$V"
"$V/bin/pip" install -q triton==3.9.0
"$V/bin/pip" install -q --no-deps sglang==0.5.23
echo "TRITON_INTERPRET=1 $V/bin/python engines/sglang/golden.py --out tests/fixtures/engines/sglang/golden.json"
