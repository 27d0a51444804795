#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: lint, unit tests, integration tests
# against a real etcd and real multi-process gloo training. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check rlaunch tests scripts examples
mypy rlaunch
python -m pytest -p no:cacheprovider "$@"
