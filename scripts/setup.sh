#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv in .venv with rlaunch, its test tools, its docs tools and the
# frameworks its integrations support (Lightning, Accelerate) installed.
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
log=$(mktemp -t rlaunch-setup-XXXX.log)
pip() {  # quiet unless it fails
  python -m pip --disable-pip-version-check "$@" >"$log" 2>&1 || { cat "$log" >&2; echo "setup: pip $* failed" >&2; exit 1; }
}
if ! python -c "import torch" 2>/dev/null; then
  pip install torch==2.13.0
fi
# docs: what tests/integration/test_docs.py builds the site with; lightning, accelerate: the framework
# integrations' tests (CPU wheels only: torch stays as installed)
pip install -e ".[test,docs,lightning,accelerate]"
python -c "import torch, aetcd, rlaunch, mkdocs, material, mkdocstrings, pytorch_lightning, lightning, accelerate" || {
  echo "setup: the installation is incomplete" >&2; exit 1; }
rm -f "$log"
