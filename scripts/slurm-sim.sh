#!/usr/bin/env bash
# A real Slurm cluster simulated on one machine: munged, slurmctld and one slurmd per
# simulated node (node1..nodeN), each slurmd in its own mount namespace with a private
# /nodetmp so that PMIx and Open MPI's shared memory do not collide between "nodes", and four
# fake GPUs per node as GRES (plain files: Slurm schedules --gres=gpu:N, nothing runs on them).
#
#   scripts/slurm-sim.sh start | stop | status
#   scripts/slurm-sim.sh kill-node NODE     # the node is lost: its slurmd, steps and ranks SIGKILLed
#   scripts/slurm-sim.sh revive-node NODE   # the node comes back (slurmd restarts and registers)
#
# Needs root and Debian's slurmctld slurmd slurm-client munge (scripts/install.sh --cluster).
set -euo pipefail

command=${1:-start}
state_dir=${HPCTK_SLURM_STATE:-/var/tmp/hpctk-slurm}
num_nodes=${HPCTK_SLURM_NODES:-4}
cpus_per_node=${HPCTK_SLURM_CPUS:-4}
slurm_conf=/etc/slurm/slurm.conf
gres_conf=/etc/slurm/gres.conf
gpus_per_node=4  # fake GPUs: plain files Slurm schedules as GRES gpu (no CUDA behind them)
host=$(hostname -s)

die() { echo "slurm-sim: $*" >&2; exit 1; }

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll a condition, never sleep blindly
    local deadline=$((SECONDS + $1)) what=$2; shift 2
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "timed out waiting for $what"
        sleep 0.5
    done
}

render_slurm_conf() {
    cat <<EOF
# Written by scripts/slurm-sim.sh: a simulated ${num_nodes}-node cluster on host ${host}.
ClusterName=hpctk-sim
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
JobRequeue=1
MinJobAge=600
# Low on purpose: a sweep of more points than this is split into several arrays (hpc.launching.sweep)
MaxArraySize=5
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
SchedulerType=sched/backfill
GresTypes=gpu
# Preemption: a job in 'high' that needs the CPUs of a job in 'debug' requeues it after
# GraceTime, and the preempted job's tasks are signalled first (preempt_send_user_signal).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
StateSaveLocation=${state_dir}/ctld
SlurmctldPidFile=${state_dir}/slurmctld.pid
SlurmctldLogFile=${state_dir}/slurmctld.log
SlurmdSpoolDir=${state_dir}/%n/spool
SlurmdPidFile=${state_dir}/%n/slurmd.pid
SlurmdLogFile=${state_dir}/%n/slurmd.log
# PMIx does not expand %n in its client tmpdir: each slurmd sees its own /nodetmp instead.
TmpFS=/nodetmp
NodeName=node[1-${num_nodes}] NodeHostname=${host} CPUs=${cpus_per_node} Gres=gpu:${gpus_per_node} RealMemory=4000 Port=[17001-$((17000 + num_nodes))] State=UNKNOWN
PartitionName=debug Nodes=node[1-${num_nodes}] Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=20
PartitionName=high Nodes=node[1-${num_nodes}] Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
}

render_gres_conf() {
    echo "# Written by scripts/slurm-sim.sh: ${gpus_per_node} fake GPUs per node (plain files)."
    echo "AutoDetect=off"
    echo "NodeName=node[1-${num_nodes}] Name=gpu File=${state_dir}/gpus/nvidia[0-$((gpus_per_node - 1))]"
}

resolve_node_names() {  # real clusters resolve node names (torch.distributed's rendezvous needs it)
    local names
    names=$(printf 'node%d ' $(seq 1 "$num_nodes"))
    grep -q "# hpctk-slurm-sim" /etc/hosts && sed -i '/# hpctk-slurm-sim$/d' /etc/hosts
    echo "127.0.0.1 ${names}# hpctk-slurm-sim" >>/etc/hosts
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
    [[ -s /etc/munge/munge.key ]] || mungekey --create --force
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged
    wait_for 20 "munged" sh -c 'munge -n | unmunge'
}

# A file system mounted under here after the start reaches every node, as a cluster's shared
# one does (the tests mount a small tmpfs here to fill it under a running job): a bind mount
# made shared, of which each node's namespace is a slave; every other mount stays the node's own.
shared_mounts="${state_dir}/mounts"

share_mounts() {
    mkdir -p "${shared_mounts}"
    findmnt -n "${shared_mounts}" >/dev/null || mount --bind "${shared_mounts}" "${shared_mounts}"
    mount --make-shared "${shared_mounts}"
}

mounts_shared() { [[ $(findmnt -n -o PROPAGATION "${shared_mounts}" 2>/dev/null) == shared ]]; }

start_slurmd() {  # one simulated node: its own mount namespace, so its own /nodetmp
    mkdir -p "${state_dir}/$1/spool" "${state_dir}/$1/tmp"
    unshare --mount --propagation slave sh -c \
        'mount --bind "$1" /nodetmp && exec slurmd -N "$2"' _ "${state_dir}/$1/tmp" "$1"
}

known_node() {
    [[ $1 =~ ^node[0-9]+$ && -d ${state_dir}/$1 ]] || die "unknown node '$1' (expected node1..node${num_nodes})"
}

kill_node() {  # everything in the node's mount namespace dies at once, as when it loses power
    known_node "$1"
    local pidfile="${state_dir}/$1/slurmd.pid" pid namespace proc link killed=0
    [[ -f $pidfile ]] && pid=$(cat "$pidfile") && namespace=$(readlink "/proc/${pid}/ns/mnt" 2>/dev/null) ||
        die "$1 is not running"
    [[ $namespace != "$(readlink /proc/self/ns/mnt)" ]] || die "$1 shares this shell's mount namespace; refusing"
    # slurmd first: a rank's connection that closes must find its node's slurmd silent, as on a
    # node that lost power (killed in /proc's order, a rank could die first and its node still
    # answer: the step supervisor then took the node for alive and waited for the heartbeats).
    kill -KILL "$pid" 2>/dev/null && killed=1
    # One find for every process's namespace (a readlink per process took seconds on a loaded
    # machine, while the node's ranks kept training); the rest in one kill.
    local others=()
    while read -r proc link; do
        [[ $link == "$namespace" ]] || continue
        proc=${proc%/ns}
        others+=("${proc#/proc/}")
    done < <(find /proc/[0-9]*/ns -maxdepth 1 -name mnt -printf '%h %l\n' 2>/dev/null || true)
    ((${#others[@]} == 0)) || { kill -KILL "${others[@]}" 2>/dev/null || true; killed=$((killed + ${#others[@]})); }
    rm -f "$pidfile"
    echo "slurm-sim: $1 lost (${killed} processes killed); slurmctld marks it DOWN after SlurmdTimeout"
}

node_state() { sinfo -h -N -n "$1" -p debug -o '%T' 2>/dev/null; }

revive_node() {
    known_node "$1"
    local pidfile="${state_dir}/$1/slurmd.pid"
    [[ -f $pidfile ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null && die "$1 is already running"
    start_slurmd "$1"
    wait_for 120 "$1 to return to service" sh -c "sinfo -h -N -n '$1' -p debug -o '%T' | grep -qxE 'idle|mixed|allocated'"
    echo "slurm-sim: $1 back ($(node_state "$1"))"
}

all_nodes_idle() {
    local states
    states=$(sinfo -h -N -p debug -o '%T' 2>/dev/null) || return 1
    [[ $(grep -c . <<<"$states") -eq $num_nodes ]] || return 1
    ! grep -qv -E '^(idle|mixed|allocated)$' <<<"$states"
}

start() {
    [[ $(id -u) -eq 0 ]] || die "needs root (it starts slurmctld, slurmd and munged)"
    command -v slurmctld >/dev/null || die "slurmctld not found: run scripts/install.sh --cluster"
    resolve_node_names
    if all_nodes_idle && mounts_shared && cmp -s <(render_slurm_conf) "${slurm_conf}" && cmp -s <(render_gres_conf) "${gres_conf}"; then
        echo "slurm-sim: already running"
        return
    fi
    stop >/dev/null 2>&1 || true
    mkdir -p "${state_dir}/ctld" "${state_dir}/gpus" /nodetmp /etc/slurm
    for ((k = 0; k < gpus_per_node; k++)); do touch "${state_dir}/gpus/nvidia${k}"; done
    render_slurm_conf >"${slurm_conf}"
    render_gres_conf >"${gres_conf}"
    share_mounts
    start_munge
    slurmctld -i
    wait_for 30 "slurmctld" scontrol ping
    local k
    for ((k = 1; k <= num_nodes; k++)); do start_slurmd "node${k}"; done
    wait_for 60 "${num_nodes} idle nodes" all_nodes_idle
    echo "slurm-sim: ${num_nodes} nodes x ${cpus_per_node} CPUs x ${gpus_per_node} fake GPUs up (partitions debug, high)"
}

kill_pidfile() {
    local pid
    [[ -f $1 ]] || return 0
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$1"
}

stop() {
    scancel --quiet --full --user="$(id -un)" 2>/dev/null || true
    local pidfile
    for pidfile in "${state_dir}"/node*/slurmd.pid; do kill_pidfile "$pidfile"; done
    kill_pidfile "${state_dir}/slurmctld.pid"
    pkill -x slurmstepd 2>/dev/null || true
    echo "slurm-sim: stopped"
}

case "$command" in
start) start ;;
stop) stop ;;
status) sinfo -N -l ;;
kill-node) kill_node "${2:?usage: $0 kill-node NODE}" ;;
revive-node) revive_node "${2:?usage: $0 revive-node NODE}" ;;
*) die "usage: $0 start|stop|status|kill-node NODE|revive-node NODE" ;;
esac
