#!/usr/bin/env bash
# Stop the Slurm cluster that start_slurm.sh started in DIR: cancel its jobs (a slurmstepd
# outlives its slurmd), then every daemon named by a pid file there, SIGTERM first, SIGKILL after 10 s.
set -uo pipefail
DIR=$(realpath "${1:?usage: stop_slurm.sh DIR}")
export SLURM_CONF="$DIR/slurm.conf"
if [ -f "$DIR/run/slurmctld.pid" ] && kill -0 "$(cat "$DIR/run/slurmctld.pid")" 2>/dev/null; then
  scancel --user "$(id -un)" 2>/dev/null
  for _ in $(seq 1 60); do
    [ -z "$(squeue -h -t running,completing,pending 2>/dev/null)" ] && break
    sleep 0.5
  done
fi
# Last resort, once the daemons are gone: any process still started under this cluster's config
# (a slurmstepd whose slurmd is gone, a job's processes) carries SLURM_CONF=DIR/slurm.conf.
stragglers() {
  local pid
  for env in /proc/[0-9]*/environ; do
    pid=${env#/proc/}; pid=${pid%/environ}
    [ "$pid" = $$ ] || [ "$pid" = "$PPID" ] && continue
    if { tr '\0' '\n' <"$env"; } 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF"; then
      kill -KILL "$pid" 2>/dev/null
    fi
  done
}

pids=()
for f in "$DIR"/run/slurmd-*.pid "$DIR"/run/slurmctld.pid "$DIR"/run/munged.pid; do
  [ -f "$f" ] || continue
  pid=$(cat "$f")
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -TERM "$pid" && pids+=("$pid"); fi
done
for _ in $(seq 1 100); do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ "$alive" = 0 ] && { stragglers; exit 0; }
  sleep 0.1
done
for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
stragglers
exit 0
