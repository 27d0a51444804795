#!/usr/bin/env bash
# Start a private Slurm cluster on this machine for the tests: munged, slurmctld and one slurmd
# per node name, every node pointing at 127.0.0.1 (Debian's slurm-wlm is built with multiple-slurmd
# support: each slurmd runs with -N NAME on its own port). Everything lives in DIR: slurm.conf, the
# munge key and socket, spool and state directories, logs and pid files. It waits until sinfo
# shows every node idle and prints the environment the clients need (SLURM_CONF=...).
#
#   tests/slurm/start_slurm.sh DIR [NODES]     # NODES: number of node names, default 3 (n1..nN)
#   tests/slurm/stop_slurm.sh DIR              # stops what this started (pid files in DIR)
#
# Exits non-zero, with the daemons' logs on stderr, when Slurm does not come up.
set -euo pipefail

DIR=$(realpath "${1:?usage: start_slurm.sh DIR [NODES]}")
NODES=${2:-3}
for tool in munged slurmctld slurmd sinfo scontrol; do
  command -v "$tool" >/dev/null || { echo "start_slurm.sh: $tool is not installed (apt-get install slurm-wlm munge)" >&2; exit 2; }
done
mkdir -p "$DIR"/{munge,state,log,run}
chmod 700 "$DIR/munge"

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# --- munge: a fresh key and a private socket, so a system munged (if any) is left alone
KEY="$DIR/munge/munge.key"
[ -f "$KEY" ] || { dd if=/dev/urandom bs=1 count=1024 of="$KEY" status=none; chmod 400 "$KEY"; }
SOCKET="$DIR/munge/munge.socket"
munged --force --key-file "$KEY" --socket "$SOCKET" --pid-file "$DIR/run/munged.pid" \
  --log-file "$DIR/log/munged.log" --seed-file "$DIR/munge/munged.seed"

# --- slurm.conf
CTLD_PORT=$(free_port)
HOST=$(hostname -s)
{
  echo "ClusterName=rlaunchtest"
  echo "SlurmctldHost=$HOST(127.0.0.1)"
  echo "SlurmctldPort=$CTLD_PORT"
  echo "SlurmUser=root"
  echo "SlurmdUser=root"
  echo "AuthType=auth/munge"
  echo "CredType=cred/munge"
  echo "AuthInfo=socket=$SOCKET"
  echo "StateSaveLocation=$DIR/state"
  echo "SlurmdSpoolDir=$DIR/spool/%n"
  echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
  echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
  echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
  echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
  echo "ProctrackType=proctrack/linuxproc"
  echo "TaskPlugin=task/none"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "JobCompType=jobcomp/none"
  echo "SwitchType=switch/none"
  echo "MpiDefault=none"
  echo "SchedulerType=sched/builtin"
  echo "SelectType=select/linear"
  echo "ReturnToService=2"
  echo "SlurmdParameters=config_overrides"
  echo "SlurmctldTimeout=30"
  echo "SlurmdTimeout=60"
  echo "InactiveLimit=0"
  echo "KillWait=5"
  echo "MinJobAge=300"
  echo "SlurmctldDebug=info"
  echo "SlurmdDebug=info"
  for i in $(seq 1 "$NODES"); do
    echo "NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$(free_port) CPUs=1 State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE"
} >"$DIR/slurm.conf"
export SLURM_CONF="$DIR/slurm.conf"

fail() {
  echo "start_slurm.sh: $*" >&2
  for f in "$DIR"/log/*; do echo "----- $f" >&2; tail -n 30 "$f" >&2; done
  exit 1
}

slurmctld -i -f "$SLURM_CONF" || fail "slurmctld did not start"
for i in $(seq 1 "$NODES"); do
  mkdir -p "$DIR/spool/n$i"
  slurmd -f "$SLURM_CONF" -N "n$i" || fail "slurmd -N n$i did not start"
done

for _ in $(seq 1 120); do
  idle=$(sinfo -h -N -t idle -o '%N' 2>/dev/null | sort -u | wc -l || true)
  [ "$idle" -ge "$NODES" ] && { echo "SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.5
done
sinfo -N -l >&2 || true
fail "the $NODES nodes did not become idle within 60 s"
