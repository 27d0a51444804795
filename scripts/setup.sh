#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with rlaunch and its test tools installed.
# Safe to re-run. torch is pinned to the CPU wheel on this disk before anything else can pull
# a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip() { python -m pip -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
if ! python -c "import torch" 2>/dev/null; then
  pip install torch==2.13.0
fi
pip install -e ".[test]"
python -c "import torch, aetcd, rlaunch" || { echo "setup: the installation is incomplete" >&2; exit 1; }
