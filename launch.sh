#!/usr/bin/env bash
# Starts every role of the system. See README.md.
#   bash launch.sh test              install test deps into .venv and run the test suite (CPU, 8 fake devices)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"

# Create the virtualenv and install a requirements file once; a stamp keyed on the file's hash makes reruns free.
setup_venv() {
  local req="$1" stamp
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  stamp="$VENV/.installed-$(basename "$req")-$(cat "$req" requirements.txt | sha1sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -r "$req"
    touch "$stamp"
  fi
  PY="$VENV/bin/python"
}

cmd="${1:-local}"; shift || true
case "$cmd" in
  test)
    setup_venv requirements-dev.txt
    XLA_FLAGS="--xla_force_host_platform_device_count=8" JAX_PLATFORMS=cpu exec "$PY" -m pytest -q tests "$@"
    ;;
  *)
    echo "usage: bash launch.sh {local|test|stop|v5p-N|v6e-N} [flags]" >&2; exit 2 ;;
esac
