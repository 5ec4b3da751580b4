#!/usr/bin/env bash
# Install the external servers the runtime and its tests use, if a later part of the project
# needs them. Nothing to install yet for planning and simulation; kept as the single place
# where the project's set-up adds system packages.
set -euo pipefail
VENV="${1:-.venv}"
test -d "$VENV"
