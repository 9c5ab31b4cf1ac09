# Sourced by engines/*/setup.sh: one cached virtualenv per engine and version, never verinfer's own,
#   ${VERINFER_ENGINES:-${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines}/<name>
# reused when a marker written after a complete install is there and the engine's modules are in
# place (checked without importing them, which keeps a reuse instant).

# engine_venv NAME MODULE...: print the venv and exit when reusable, else create it empty (sets VENV).
engine_venv() {
  local name=$1; shift
  ENGINES="${VERINFER_ENGINES:-${VERINFER_CACHE:-$HOME/.cache/verinfer}/engines}"
  VENV="$ENGINES/$name"
  MARK="$VENV/.verinfer-complete"
  local modules
  modules=$(printf "'%s'," "$@")
  if [ -f "$MARK" ] && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ($modules)))" 2>/dev/null; then
    echo "$VENV"
    exit 0
  fi
  START=$(date +%s)
  rm -rf "$VENV"
  mkdir -p "$ENGINES"
  "${PYTHON:-python3}" -m venv "$VENV"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  "$VENV/bin/pip" install -q --upgrade pip >&2
}

# engine_done: write the marker (the install's duration) and print the venv.
engine_done() {
  echo "install_seconds=$(( $(date +%s) - START ))" > "$MARK"
  cat "$MARK" >&2
  echo "$VENV"
}
