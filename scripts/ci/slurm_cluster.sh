#!/usr/bin/env bash
# A real, throw-away Slurm cluster on this one machine, for CI: Debian's Slurm (installed when missing),
# N fake nodes (one slurmd each, all at 127.0.0.1), optional fake GPUs, no munge (auth/none).
# CI submits the project's own sbatch scripts to it (tests/slurm/).
#
#   source scripts/ci/slurm_cluster.sh
#   slurm_up                              # ~1 s when installed, ~10 s with the install
#   jid=$(sbatch --parsable scripts/slurm/gspo.sbatch); slurm_wait "$jid" 600; slurm_down
#   scripts/ci/slurm_cluster.sh up|down   # the same from a shell
#
# Knobs (environment): SLURM_CI_DIR (state, logs, slurm.conf; default ${TMPDIR:-/tmp}/megatron-gspo-slurm),
#   SLURM_CI_NODES (fake nodes n1..nN, default 2), SLURM_CI_CPUS (CPUs claimed per node, default 16),
#   SLURM_CI_MEM_MB (per node, default 16000), SLURM_CI_GPUS (fake GPUs per node, default 8: the H100
#   job scripts ask for them; tasks see CUDA_VISIBLE_DEVICES, nothing else), SLURM_CI_PORT (slurmctld,
#   default 6817; slurmd ports are 17000+i), SLURM_CI_KILL_WAIT (seconds between SIGTERM and SIGKILL
#   when a job is cancelled or requeued, default 60: a trainer finishes its step and checkpoints in it).
# Resources are claimed above the real ones on purpose (SlurmdParameters=config_overrides).
SLURM_CI_DIR=${SLURM_CI_DIR:-${TMPDIR:-/tmp}/megatron-gspo-slurm}
export SLURM_CONF=$SLURM_CI_DIR/slurm.conf

slurm_install() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || {
    echo "slurm_cluster: Slurm is not installed and cannot be (needs root and apt-get)" >&2; return 1; }
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends slurmctld slurmd slurm-client >/dev/null
}

slurm_up() {
  local d=$SLURM_CI_DIR n=${SLURM_CI_NODES:-2} cpus=${SLURM_CI_CPUS:-16} mem=${SLURM_CI_MEM_MB:-16000}
  local gpus=${SLURM_CI_GPUS:-8} port=${SLURM_CI_PORT:-6817} i
  slurm_install || return 1
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "slurm_cluster: port $port is in use (another slurmctld? try slurm_down)" >&2; return 1
  fi
  rm -rf "$d"; mkdir -p "$d/state" "$d/log"
  cat > "$SLURM_CONF" <<CONF
ClusterName=ci
SlurmctldHost=localhost
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd-%n.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$d/jobcomp.log
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
MinJobAge=3600
KillWait=${SLURM_CI_KILL_WAIT:-60}
InactiveLimit=0
EnforcePartLimits=ALL
$( [ "$gpus" -gt 0 ] && echo GresTypes=gpu )
CONF
  for i in $(seq 1 "$n"); do
    echo "NodeName=n$i NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$cpus" \
         "RealMemory=$mem $( [ "$gpus" -gt 0 ] && echo "Gres=gpu:$gpus") State=UNKNOWN" >> "$SLURM_CONF"
    mkdir -p "$d/spool/n$i"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$SLURM_CONF"
  if [ "$gpus" -gt 0 ]; then  # gres needs device files: links to /dev/null stand in for /dev/nvidiaN
    mkdir -p "$d/fakegpu"
    for i in $(seq 0 $((gpus - 1))); do ln -sf /dev/null "$d/fakegpu/nvidia$i"; done
    printf 'AutoDetect=off\nName=gpu File=%s/fakegpu/nvidia[0-%d]\n' "$d" $((gpus - 1)) > "$d/gres.conf"
  fi
  # Job scripts build URLs and rendezvous addresses from node names: make n1..nN resolve (to here).
  for i in $(seq 1 "$n"); do getent hosts "n$i" >/dev/null || echo "127.0.0.1 n$i" >> /etc/hosts; done
  # Daemons fork into the background; they must not inherit a closed stdin (CI has none).
  slurmctld -f "$SLURM_CONF" </dev/null || return 1
  for i in $(seq 1 "$n"); do slurmd -f "$SLURM_CONF" -N "n$i" </dev/null || return 1; done
  for _ in $(seq 1 100); do  # up to 20 s until every node is idle
    [ "$(sinfo -h -N -t idle -o '%N' 2>/dev/null | grep -c '^n[0-9]')" = "$n" ] && return 0
    sleep 0.2
  done
  echo "slurm_cluster: nodes did not come up" >&2; sinfo -N >&2; tail -n 20 "$d"/log/*.log >&2; return 1
}

# slurm_wait JOBID [TIMEOUT_S]: wait until the job has ended (a requeued job is waited through);
# print "STATE EXIT" (e.g. "COMPLETED 0:0"); return 0 only for COMPLETED. On timeout: cancel, return 124.
slurm_wait() {
  local jid=$1 t=${2:-3600} start=$SECONDS info state ec
  while :; do
    info=$(scontrol -o show job "$jid" 2>/dev/null)
    state=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$info" | head -n1)
    case $state in PENDING|CONFIGURING|RUNNING|COMPLETING|SUSPENDED|REQUEUED|REQUEUE_HOLD|RESIZING|"") ;;
      *) break ;; esac
    if (( SECONDS - start > t )); then scancel "$jid"; echo "TIMEOUT(ci) -"; return 124; fi
    sleep 0.5
  done
  ec=$(sed -n 's/.* ExitCode=\([0-9]*:[0-9]*\).*/\1/p' <<<"$info" | head -n1)
  echo "$state $ec"
  [ "$state" = COMPLETED ]
}

# slurm_down: cancel every job (jobs outlive 'scontrol shutdown'), stop the daemons, SIGKILL stragglers.
slurm_down() {
  local d=$SLURM_CI_DIR p pids=""
  [ -f "$SLURM_CONF" ] || return 0
  if squeue -h -o %A 2>/dev/null | grep -q .; then
    # shellcheck disable=SC2046  # one word per job id
    scancel --full $(squeue -h -o %A) 2>/dev/null
    for _ in $(seq 1 240); do squeue -h -o %A 2>/dev/null | grep -q . || break; sleep 0.25; done
  fi
  for p in "$d"/slurmctld.pid "$d"/slurmd-*.pid; do [ -f "$p" ] && pids="$pids $(cat "$p")"; done
  scontrol shutdown >/dev/null 2>&1
  for p in $pids; do for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done; done
  for p in $pids; do kill -0 "$p" 2>/dev/null && kill -9 "$p"; done
  return 0
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then  # executed, not sourced
  case ${1:-} in
    up) slurm_up && echo "export SLURM_CONF=$SLURM_CONF" ;;
    down) slurm_down ;;
    wait) slurm_wait "${@:2}" ;;
    *) echo "usage: $0 up|down|wait JOBID [TIMEOUT_S]" >&2; exit 2 ;;
  esac
fi
