#!/usr/bin/env bash
# The rlaunch demo: a 2-node DDP job plus two warm standbys on one machine, against an embedded
# etcd. Partway through, node-b is drained for maintenance: its rank moves live to the warm
# standby node-c while node-a keeps its process, and the measured downtime is printed. Then
# node-a's worker is SIGKILLed: node-d takes its rank live, with its state from node-c's
# replica, and node-c keeps its process. `rlaunch status` is printed along the way. Sets up a
# virtualenv first if needed; `--no-setup` skips that (to run it again, or offline).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") bash scripts/setup.sh ;;
  --no-setup)
    [ -x .venv/bin/python ] || {
      echo "demo: --no-setup needs the virtualenv in .venv; run scripts/demo.sh once without it." >&2; exit 2; } ;;
  *) echo "demo: unknown argument '$1'; run scripts/demo.sh, or scripts/demo.sh --no-setup to skip the setup." >&2
     exit 2 ;;
esac
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
# its TLS client certificate, for every rlaunch command below (etcdctl's variables)
eval "$(grep '^export ETCDCTL_' "$work/etcd.log")"
JOB=demo
echo "etcd at $EP, job id $JOB, logs in $work"

node_field() {  # node_field NODE FIELD: one field of a node in `rlaunch status --json`
  # Prints "" (never a traceback) while the job or the node does not exist yet.
  rlaunch status --rdzv-endpoint "$EP" --rdzv-id "$JOB" --json 2>/dev/null | python -c '
import json, sys
try:
    s = json.loads(sys.stdin.read() or "{}")
except ValueError:
    s = {}
print(next((n.get(sys.argv[2], "") for n in s.get("nodes", []) if n.get("node_id") == sys.argv[1]), ""))' "$1" "$2" || true
}
wait_until() {  # wait_until SECONDS DESCRIPTION COMMAND...
  local t=$1 what=$2; shift 2
  for _ in $(seq $((t * 5))); do "$@" && return 0; sleep 0.2; done
  echo "demo: timed out waiting for $what" >&2; exit 1
}
registered() { [ -n "$(node_field "$1" state)" ]; }
running_active() { [ "$(node_field "$1" role)" = active ] && [ "$(node_field "$1" state)" = running ]; }
warm_standby() { [ "$(node_field "$1" state)" = standby ] && [ "$(node_field "$1" runtime)" = True ]; }

declare -A agent
for node in node-a node-b node-c node-d; do
  rlaunch --nnodes 2 --nproc-per-node 1 --rdzv-endpoint "$EP" --rdzv-id "$JOB" --node-id "$node" \
    --max-restarts 3 --lease-ttl 3 \
    examples/train_resilient.py --steps 600 --step-time 0.05 --width 256 \
    >"$work/$node.log" 2>&1 &
  agent[$node]=$!
  pids+=($!)
  wait_until 60 "$node to join" registered "$node"
done

say "4 agents joined: node-a, node-b active; node-c, node-d warm up as standbys"
wait_until 120 "training to start" running_active node-b
wait_until 120 "node-c to be a warm standby" warm_standby node-c
wait_until 120 "node-d to be a warm standby" warm_standby node-d
rlaunch status --rdzv-endpoint "$EP" --rdzv-id "$JOB"

say "draining node-b live: its rank moves to node-c; node-a keeps its process"
rlaunch drain node-b --rdzv-endpoint "$EP" --rdzv-id "$JOB"
rlaunch status --rdzv-endpoint "$EP" --rdzv-id "$JOB"

say "a crash: SIGKILL node-a's worker; node-d takes rank 0 live, node-c keeps on"
pkill -KILL -P "${agent[node-a]}"
wait_until 60 "node-d to take rank 0" running_active node-d
rlaunch status --rdzv-endpoint "$EP" --rdzv-id "$JOB"

say "waiting for the job to finish"
rc=()
for node in node-a node-b node-c node-d; do
  code=0; wait "${agent[$node]}" || code=$?; rc+=("$node exited $code")
done
printf '%s\n' "${rc[@]}"
grep -h "final:" "$work/node-c.log" "$work/node-d.log" || true
rlaunch events --rdzv-endpoint "$EP" --rdzv-id "$JOB" \
  | grep -E "drain_requested|plan=migrate|state_sent|switched|drained|workers_failed|plan=replace|recovered|joined" || true
for line in "${rc[@]}"; do
  case "$line" in *"exited 0") ;; *) echo "demo: the job failed; logs in $work" >&2; exit 1 ;; esac
done
say "node-b drained, node-a's crash recovered, both live; node-c and node-d end"
echo "   with the same weights. Logs: $work"
