#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for testing megacore's SlurmExecutor against a real Slurm.
#
#   scripts/slurm_local.sh install     apt-get install slurmctld slurmd slurm-client munge when missing
#                                      (root with apt-get only)
#   scripts/slurm_local.sh start DIR   write DIR/slurm.conf, start munged, slurmctld and slurmd with all their
#                                      state, sockets, logs and pid files in DIR, wait until the node is idle
#   scripts/slurm_local.sh stop DIR    cancel DIR's jobs, stop its daemons by their pid files
#
# Nothing outside DIR is touched after the install: its own munge key and socket (so a site's munged, if any,
# is left alone), free TCP ports for slurmctld and slurmd, node "localhost" (slurmd -N localhost) with the
# CPUs, sockets, cores and memory that `slurmd -C` reports. Clients find the cluster through
# SLURM_CONF=DIR/slurm.conf; `start` prints that line last.
#
# Exit codes: 0 ok; 3 Slurm cannot run here (not root, no apt-get, a daemon did not start: the reason is on
# stderr, a test skips on it); anything else is a bug in this script.
set -uo pipefail

die_env() { echo "slurm_local: $*" >&2; exit 3; }
have_all() { command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged; } >/dev/null 2>&1

install() {
  have_all && return 0
  [ "$(id -u)" -eq 0 ] || die_env "Slurm is not installed and installing it needs root (apt-get install slurmctld slurmd slurm-client munge)"
  command -v apt-get >/dev/null 2>&1 || die_env "Slurm is not installed and there is no apt-get to install it"
  echo "[slurm_local] apt-get install slurmctld slurmd slurm-client munge" >&2
  # The packages' postinst scripts would start the system's munged/slurmctld/slurmd; ours run from DIR, so a
  # policy-rc.d (unless the machine has one) tells invoke-rc.d not to start services while installing.
  local policy=/usr/sbin/policy-rc.d own_policy=0 ok=1
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' >$policy && chmod 755 $policy && own_policy=1; fi
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      slurmctld slurmd slurm-client munge; } >"${TMPDIR:-/tmp}/slurm_local_apt.log" 2>&1 || ok=0
  [ $own_policy -eq 1 ] && rm -f $policy
  if [ $ok -eq 0 ]; then
    tail -n 5 "${TMPDIR:-/tmp}/slurm_local_apt.log" >&2
    die_env "apt-get install of Slurm failed (log: ${TMPDIR:-/tmp}/slurm_local_apt.log)"
  fi
  have_all || die_env "Slurm's packages installed but slurmctld/slurmd/sbatch/munged are still not on PATH"
}

# Two distinct free TCP ports (both bound at once, so they differ).
free_ports() {
  python3 -c 'import socket; s = [socket.socket() for _ in range(2)]; [x.bind(("127.0.0.1", 0)) for x in s]
print(*[x.getsockname()[1] for x in s])'
}

# Waits up to $1 seconds for the command in the other arguments to succeed.
wait_for() {
  local t=$1; shift
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    [ $SECONDS -ge $end ] && return 1
    sleep 0.5
  done
}

start() {
  local dir=$1
  have_all || die_env "Slurm is not installed (run: $0 install)"
  [ "$(id -u)" -eq 0 ] || die_env "starting slurmd needs root (it starts job steps as their users)"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  mkdir -p "$dir/munge" "$dir/state" "$dir/spool"
  chmod 755 "$dir/munge"  # clients need to reach the socket; munged refuses a dir others can write to

  # munged insists on a private key file and a socket directory that others cannot write to.
  head -c 1024 /dev/urandom >"$dir/munge/munge.key"
  chmod 400 "$dir/munge/munge.key"
  local sock="$dir/munge/munge.socket"
  munged --force --socket="$sock" --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed" 2>"$dir/munge/start.err" \
    || die_env "munged did not start: $(tail -n 3 "$dir/munge/start.err" "$dir/munge/munged.log" 2>/dev/null | tr '\n' ' ')"
  wait_for 10 test -S "$sock" || die_env "munged started but its socket $sock did not appear"

  # The node as slurmd sees it (CPUs, boards, sockets, cores, threads, memory), renamed to localhost.
  local hw
  hw=$(slurmd -C 2>/dev/null | head -n 1 | sed -E 's/^NodeName=[^ ]+ //')
  [ -n "$hw" ] || die_env "slurmd -C printed nothing (cannot read this machine's hardware)"
  local ports
  read -r -a ports <<<"$(free_ports)"
  cat >"$dir/slurm.conf" <<EOF
# One-node test cluster written by megacore's scripts/slurm_local.sh (Slurm $(slurmd -V | awk '{print $2}')).
ClusterName=megacore-local
SlurmctldHost=localhost
SlurmctldPort=${ports[0]}
SlurmdPort=${ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
# No cgroups (containers often lack a writable cgroup tree): processes are tracked by parentage, and tasks are
# bound (when asked) with sched_setaffinity.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
# A finished job stays visible to scontrol for 10 minutes (there is no accounting database for sacct).
MinJobAge=600
KillWait=5
NodeName=localhost NodeAddr=127.0.0.1 $hw State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="$dir/slurm.conf"
  slurmctld -f "$SLURM_CONF" 2>"$dir/slurmctld.err" \
    || die_env "slurmctld did not start: $(tail -n 3 "$dir/slurmctld.err" "$dir/slurmctld.log" 2>/dev/null | tr '\n' ' ')"
  slurmd -f "$SLURM_CONF" -N localhost 2>"$dir/slurmd.err" \
    || die_env "slurmd did not start: $(tail -n 3 "$dir/slurmd.err" "$dir/slurmd.log" 2>/dev/null | tr '\n' ' ')"
  if ! wait_for 60 bash -c '[ "$(sinfo -h -N -n localhost -o %t 2>/dev/null)" = idle ]'; then
    local state
    state=$(sinfo -h -N -o '%N %t %E' 2>&1 | head -n 3)
    die_env "the node did not become idle within 60 s (sinfo: ${state:-nothing}); logs in $dir: " \
      "$(tail -n 2 "$dir/slurmctld.log" "$dir/slurmd.log" 2>/dev/null | tr '\n' ' ')"
  fi
  echo "SLURM_CONF=$SLURM_CONF"
}

# Sends SIGTERM to the pid in file $1 (if that process is alive), SIGKILL after 10 s.
stop_pidfile() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f" 2>/dev/null)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.25; done
  kill -KILL "$pid" 2>/dev/null
  echo "slurm_local: $f's process $pid needed SIGKILL" >&2
}

stop() {
  local dir=$1
  [ -d "$dir" ] || return 0
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/slurm.conf" ] && [ -f "$dir/slurmctld.pid" ]; then
    export SLURM_CONF="$dir/slurm.conf"
    scancel --full --quiet --partition=debug 2>/dev/null
    # Job steps end before their slurmd goes: slurmstepd has no pid file of its own.
    wait_for 20 bash -c '[ -z "$(squeue -h -t RUNNING,COMPLETING,PENDING -o %i 2>/dev/null)" ]' \
      || echo "slurm_local: jobs still listed after scancel: $(squeue -h 2>&1 | head -n 3)" >&2
  fi
  stop_pidfile "$dir/slurmd.pid"
  stop_pidfile "$dir/slurmctld.pid"
  stop_pidfile "$dir/munge/munged.pid"
}

case "${1:-}" in
  install) install ;;
  start) [ $# -eq 2 ] || { echo "usage: $0 start DIR" >&2; exit 2; }; start "$2" ;;
  stop) [ $# -eq 2 ] || { echo "usage: $0 stop DIR" >&2; exit 2; }; stop "$2" ;;
  *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac
