#!/usr/bin/env bash
# The README's quick start from nothing (issue #37, item 5): a new venv, an empty HOME (so no pip cache)
# and an empty VERINFER_CACHE; the README's own line (tests/install_blocks.py), its installs timed, then
# its job. Prints one markdown row: install wall time, venv size, job wall time, load average before and
# after. Run it on an idle machine for the README's figures:
#   bash benchmarks/quick_start.sh >> benchmarks/results/quick_start.md
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
D=$(mktemp -d /tmp/verinfer-quick-start.XXXXXX)
trap 'rm -rf "$D"' EXIT
mkdir -p "$D/home" "$D/cache"
LOAD0=$(cut -d' ' -f1 /proc/loadavg)
"$PY" -m venv "$D/venv"
source "$D/venv/bin/activate"
export HOME="$D/home" VERINFER_CACHE="$D/cache" HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
T=$(date +%s%N)
bash -c "$("$PY" tests/install_blocks.py installs quick-start)" >"$D/install.log" 2>&1
INSTALL=$(( ($(date +%s%N) - T) / 1000000000 ))
SIZE=$(du -sh "$D/venv" | cut -f1)
rm -rf verinfer-demo
T=$(date +%s%N)
bash -c "$("$PY" tests/install_blocks.py job quick-start)" >"$D/out.txt" 2>&1
JOB=$(( ($(date +%s%N) - T) / 1000000000 ))
"$PY" tests/install_blocks.py check "$D/out.txt" "$PWD" >&2
printf '| %s | %s | %d s | %s | %d s | %s -> %s |\n' "$(date -u +%FT%H:%MZ)" "$(nproc) cores" "$INSTALL" "$SIZE" "$JOB" \
  "$LOAD0" "$(cut -d' ' -f1 /proc/loadavg)"
