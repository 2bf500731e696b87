#!/usr/bin/env bash
# A one-node SLURM cluster on loopback, for tests: `cluster.sh start DIR` / `cluster.sh stop DIR`.
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge when missing (needs root
# or sudo), writes DIR/slurm.conf, wipes the state (a stale state leaves the node
# drained), and starts munged, slurmctld and slurmd with their pid files in DIR. `stop`
# ends only the daemons whose pid files are in DIR. Commands then need
# SLURM_CONF=DIR/slurm.conf.
set -euo pipefail

action=${1:?usage: cluster.sh start|stop DIR}
dir=$(mkdir -p "${2:?usage: cluster.sh start|stop DIR}" && cd "$2" && pwd)
cpus=${HPCTRAIN_SLURM_CPUS:-8}   # declared CPUs; config_overrides lets it exceed the real count
sudo_cmd=$([ "$(id -u)" = 0 ] || echo sudo)

install() {
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
     || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    $sudo_cmd apt-get update -q
    $sudo_cmd env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
      --no-install-recommends slurmctld slurmd slurm-client munge
  fi
}

write_conf() {
  local user; user=$(id -un)
  # job ids differ from one start to the next: MPICH names its shared-memory segments
  # after the job step, and a segment left by a killed job would be joined by the next
  # job with the same id (MPI_Init then fails: "failed to unpack address", "truncated")
  local first_job_id=$(( ($(date +%s) % 100000) * 100 + 1 ))
  cat > "$dir/slurm.conf" <<CONF
ClusterName=hpctrain-test
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=$user
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket,cred_expire=10
CredType=cred/munge
SlurmctldPort=${HPCTRAIN_SLURMCTLD_PORT:-16817}
SlurmdPort=${HPCTRAIN_SLURMD_PORT:-16818}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=pmi2
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
FirstJobId=$first_job_id
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
NodeName=localhost NodeAddr=127.0.0.1 NodeHostname=$(hostname -s) CPUs=$cpus RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

start() {
  install
  stop_daemons
  rm -rf "$dir/state" "$dir/spool"
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
  write_conf
  if [ ! -s /etc/munge/munge.key ]; then
    $sudo_cmd sh -c 'dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null'
  fi
  $sudo_cmd munged --force --socket="$dir/munge.socket" --pid-file="$dir/munged.pid" \
    --seed-file="$dir/munge/seed" --log-file="$dir/munged.log"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF"
  $sudo_cmd env SLURM_CONF="$SLURM_CONF" slurmd -f "$SLURM_CONF" -N localhost
  for _ in $(seq 60); do
    # our own daemons must be the ones answering (not another cluster on these ports)
    if ! alive slurmctld || ! alive slurmd; then sleep 0.5; fi
    if alive slurmctld && alive slurmd && sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "slurm: one-node cluster up in $dir (SLURM_CONF=$SLURM_CONF)"
      return 0
    fi
    sleep 1
  done
  echo "slurm: the node did not become idle; logs in $dir" >&2
  sinfo -N -l >&2 || true
  tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
  return 1
}

alive() {
  [ -s "$dir/$1.pid" ] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null
}

stop_daemons() {
  for name in slurmd slurmctld munged; do
    local pidfile="$dir/$name.pid"
    if [ -s "$pidfile" ]; then
      local pid; pid=$(cat "$pidfile")
      $sudo_cmd kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      rm -f "$pidfile"
    fi
  done
}

case $action in
  start) start ;;
  stop) stop_daemons; echo "slurm: daemons of $dir stopped" ;;
  *) echo "usage: cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
