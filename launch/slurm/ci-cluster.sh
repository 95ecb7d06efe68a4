#!/usr/bin/env bash
# A real one-node Slurm cluster for CI and for trying the batch scripts by hand.
#
#   bash launch/slurm/ci-cluster.sh start    # install (if missing), configure, start, wait until idle
#   bash launch/slurm/ci-cluster.sh stop     # cancel jobs, stop slurmd, slurmctld and munged
#   bash launch/slurm/ci-cluster.sh status   # sinfo, exit 0 when the node answers
#
# Debian's slurmctld, slurmd, slurm-client and munge; no systemd, no cgroups: munged runs as the
# munge user, slurmctld as the slurm user, slurmd as root. MpiDefault=pmi2, ProctrackType=proctrack/pgid,
# select/cons_tres, ReturnToService=2. Idempotent: a second `start` with the cluster up returns at once.
# Needs root (apt-get, daemons). Every wait is bounded.
set -euo pipefail

CONF_DIR=${KOG_SLURM_CONF_DIR:-/etc/slurm}
CONF=$CONF_DIR/slurm.conf
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
LOGS=/var/log/slurm
RUN=/run/kog-slurm
NODE=$(hostname -s)
PARTITION=ci

log() { echo "ci-cluster: $*" >&2; }

have_all() { command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null \
             && command -v sbatch >/dev/null && command -v munged >/dev/null; }

install() {
  have_all && return 0
  [ "$(id -u)" = 0 ] || { log "not root: cannot apt-get install slurm"; return 1; }
  log "installing slurmctld slurmd slurm-client munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -q >/dev/null
  timeout 600 apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  have_all
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

node_state() { timeout 10 sinfo -h -n "$NODE" -o %t 2>/dev/null | head -n1 | tr -d ' *~#'; }

write_conf() {
  # The node line exactly as slurmd sees the hardware (CPUs, sockets, cores, memory).
  local hw
  hw=$(slurmd -C | head -n1 | sed -e 's/^NodeName=[^ ]* //')
  mkdir -p "$CONF_DIR"
  cat >"$CONF.new" <<EOF
# Written by launch/slurm/ci-cluster.sh: a one-node cluster for CI.
ClusterName=kogci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=slurm
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=pmi2
ProctrackType=proctrack/pgid
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
SchedulerType=sched/backfill
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
UnkillableStepTimeout=30
DefMemPerCPU=2048
NodeName=$NODE NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
  if ! cmp -s "$CONF.new" "$CONF" 2>/dev/null; then mv "$CONF.new" "$CONF"; return 0; fi
  rm -f "$CONF.new"; return 1   # unchanged
}

start_munge() {
  mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge
  chmod 0755 /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    log "creating the munge key"
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key --force
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none; fi
  fi
  chown munge:munge /etc/munge/munge.key; chmod 0400 /etc/munge/munge.key
  if timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; then return 0; fi
  rm -f /run/munge/munged.pid
  if command -v runuser >/dev/null; then runuser -u munge -- /usr/sbin/munged
  else su -s /bin/sh munge -c /usr/sbin/munged; fi
  for _ in $(seq 50); do
    timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1 && return 0; sleep 0.2
  done
  log "munged did not come up"; return 1
}

start() {
  install || { log "Slurm is not installed and could not be installed"; return 1; }
  local changed=0
  write_conf && changed=1
  if [ $changed = 0 ] && pid_alive $RUN/slurmctld.pid && pid_alive $RUN/slurmd.pid; then
    case "$(node_state)" in idle|mix|alloc|comp) log "already up ($NODE $(node_state))"; return 0;; esac
  fi
  [ $changed = 1 ] && { stop_daemons || true; }
  mkdir -p $STATE $SPOOL $LOGS $RUN
  chown slurm:slurm $STATE $LOGS $RUN
  start_munge
  if ! pid_alive $RUN/slurmctld.pid; then
    log "starting slurmctld"
    slurmctld -f "$CONF" -c -i
  fi
  if ! pid_alive $RUN/slurmd.pid; then
    log "starting slurmd"
    slurmd -f "$CONF"
  fi
  local st=""
  for i in $(seq 120); do
    st=$(node_state)
    case "$st" in
      idle|mix|alloc) log "up: node $NODE $st"; timeout 10 sinfo >&2 || true; return 0;;
      down|drain|drng|fail|failg)
        [ $((i % 10)) = 1 ] && timeout 10 scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true;;
    esac
    sleep 0.5
  done
  log "node $NODE not idle after 60 s (state '$st'); logs:"
  tail -n 20 $LOGS/slurmctld.log $LOGS/slurmd.log >&2 || true
  return 1
}

kill_pidfile() {  # pidfile name
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { log "$name did not stop on SIGTERM; SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
  fi
  rm -f "$f"
}

stop_daemons() {
  local name
  name=slurmd kill_pidfile $RUN/slurmd.pid
  name=slurmctld kill_pidfile $RUN/slurmctld.pid
}

stop() {
  if command -v scancel >/dev/null && pid_alive $RUN/slurmctld.pid; then
    timeout 10 scancel --full --user="$(id -un)" >/dev/null 2>&1 || true
    # Give the job steps their SIGTERM and KillWait before the daemons go.
    for _ in $(seq 30); do
      [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5
    done
  fi
  stop_daemons
  name=munged kill_pidfile /run/munge/munged.pid
  log "stopped"
}

case "${1:-}" in
  start) start;;
  stop) stop;;
  status) timeout 10 sinfo;;
  restart) stop; start;;
  *) echo "usage: $0 start|stop|status|restart" >&2; exit 2;;
esac
