#!/usr/bin/env bash
# The rlaunch demo: a 2-node DDP job plus a warm standby on one machine, against an embedded
# etcd. Partway through, one active node is killed (SIGKILL, agent and workers, as a machine
# loss); the standby takes its node rank and the job completes. `rlaunch status` is printed
# before and after. Sets up a virtualenv first if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate

work=$(mktemp -d -t rlaunch-demo-XXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "starting an embedded etcd (rlaunch etcd)"
rlaunch etcd --port 0 >"$work/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "listening on" "$work/etcd.log" && break; sleep 0.1; done
EP=$(sed -n 's/^etcd listening on //p' "$work/etcd.log")
[ -n "$EP" ] || { echo "demo: etcd did not start; see $work/etcd.log" >&2; exit 1; }
JOB=demo
echo "etcd at $EP, job id $JOB, logs in $work"

node_field() {  # node_field NODE FIELD: one field of a node in `rlaunch status --json`
  rlaunch status --rdzv-endpoint "$EP" --rdzv-id "$JOB" --json 2>/dev/null | python -c '
import json, sys
s = json.load(sys.stdin)
print(next((n[sys.argv[2]] for n in s["nodes"] if n["node_id"] == sys.argv[1]), ""))' "$1" "$2" || true
}
wait_until() {  # wait_until SECONDS DESCRIPTION COMMAND...
  local t=$1 what=$2; shift 2
  for _ in $(seq $((t * 5))); do "$@" && return 0; sleep 0.2; done
  echo "demo: timed out waiting for $what" >&2; exit 1
}
registered() { [ -n "$(node_field "$1" state)" ]; }
running_active() { [ "$(node_field "$1" role)" = active ] && [ "$(node_field "$1" state)" = running ]; }

declare -A agent
for node in node-a node-b node-c; do
  rlaunch --nnodes 2 --nproc-per-node 1 --rdzv-endpoint "$EP" --rdzv-id "$JOB" --node-id "$node" \
    --max-restarts 3 --lease-ttl 3 \
    examples/train.py --steps 60 --step-time 0.1 --ckpt "$work/ckpt.pt" --ckpt-every 10 \
    >"$work/$node.log" 2>&1 &
  agent[$node]=$!
  pids+=($!)
  wait_until 60 "$node to join" registered "$node"
done

say "3 agents joined: node-a and node-b are active, node-c is a warm standby"
wait_until 120 "training to start" running_active node-b
wait_until 120 "the first checkpoint" test -f "$work/ckpt.pt"
rlaunch status --rdzv-endpoint "$EP" --rdzv-id "$JOB"

say "killing node-b (agent and workers, SIGKILL) partway through training"
killed_at=$(date +%s.%N)
pkill -KILL -P "${agent[node-b]}" || true
kill -KILL "${agent[node-b]}"
wait_until 60 "node-c to take over" running_active node-c
took=$(python -c "import time; print(f'{time.time() - $killed_at:.1f}')")
echo "node-c took node rank $(node_field node-c node_rank) ${took} s after the kill"
rlaunch status --rdzv-endpoint "$EP" --rdzv-id "$JOB"

say "waiting for the job to finish"
rc_a=0; rc_c=0
wait "${agent[node-a]}" || rc_a=$?
wait "${agent[node-c]}" || rc_c=$?
grep -h "resumed from step\|done: steps" "$work/node-a.log" "$work/node-c.log" || true
echo "node-a exited $rc_a, node-c exited $rc_c"
[ "$rc_a" = 0 ] && [ "$rc_c" = 0 ] || { echo "demo: the job failed; logs in $work" >&2; exit 1; }
say "the job completed after losing a node; logs in $work"
