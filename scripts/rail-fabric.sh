#!/usr/bin/env bash
# An emulated rail-optimized fabric on one machine (root; Linux network namespaces).
#
#   scripts/rail-fabric.sh up NODES RAILS RATE     e.g. up 4 2 200mbit
#   scripts/rail-fabric.sh down
#   scripts/rail-fabric.sh status
#   scripts/rail-fabric.sh exec rnK CMD...          run CMD inside node K (hostname rnK)
#   scripts/rail-fabric.sh agent HOST CMD...        Open MPI's plm_rsh_agent: start CMD on HOST
#
# Node k is the namespace hpcrail-rnK, hostname rnK (not nodeK: the simulated Slurm maps node1..4 to
# 127.0.0.1 in /etc/hosts), with interfaces rail0..rail(R-1) (10.<r+1>.0.<k+1>/24)
# and mgmt (10.100.0.<k+1>/24, unshaped, for the launcher). Rail r of every node is a veth into
# the bridge br-rail<r>, shaped with tc tbf to RATE in both directions: a leaf switch per rail.
# Every node has an interface on every rail, so a packet for another rail's address leaves
# through the sender's own interface on that rail: no spine is needed (and none is emulated).
# The bridges live in the namespace hpcrail-fabric, where mpirun runs too (the launcher talks to
# the nodes over mgmt); nothing is added to the namespace this script is started from, so no
# traffic leaves the namespaces it created. `down` removes all of them.
set -euo pipefail

prefix=hpcrail
fabric=$prefix-fabric

die() { echo "rail-fabric: $*" >&2; exit 2; }
in_fabric() { ip netns exec "$fabric" "$@"; }
node_ns() { echo "$prefix-rn$1"; }

shape() {  # namespace interface rate: tbf on the interface's egress
    # burst >= one 64 KiB GSO segment. The queue is short (LATENCY): a ring step sends both
    # ways on one rail, and the ACKs of one direction wait behind the other's queued data; with
    # 100 ms of queue TCP got about half the rate (RDMA has no such coupling). This kernel has
    # no fq_codel/sfq to separate them, so the queue is kept short instead.
    ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst 256kb latency "${RAIL_FABRIC_LATENCY:-5ms}"
}

up() {
    local nodes=$1 rails=$2 rate=$3
    [[ $nodes =~ ^[0-9]+$ && $nodes -ge 2 && $nodes -le 32 ]] || die "NODES must be 2..32, got '$nodes'"
    [[ $rails =~ ^[0-9]+$ && $rails -ge 1 && $rails -le 8 ]] || die "RAILS must be 1..8, got '$rails'"
    [[ $rate =~ ^[0-9]+(kbit|mbit|gbit)$ ]] || die "RATE must look like 200mbit or 1gbit, got '$rate'"
    [[ $(id -u) -eq 0 ]] || die "needs root (network namespaces)"
    command -v tc >/dev/null || die "tc (iproute2) is missing"
    down quiet
    ip netns add "$fabric"
    in_fabric ip link set lo up
    in_fabric ip link add br-mgmt type bridge
    in_fabric ip addr add 10.100.0.254/24 dev br-mgmt
    in_fabric ip link set br-mgmt up
    for ((r = 0; r < rails; r++)); do
        in_fabric ip link add "br-rail$r" type bridge
        in_fabric ip addr add "10.$((r + 1)).0.254/24" dev "br-rail$r"
        in_fabric ip link set "br-rail$r" up
    done
    for ((k = 0; k < nodes; k++)); do
        local ns
        ns=$(node_ns "$k")
        ip netns add "$ns"
        ip netns exec "$ns" ip link set lo up
        # Replies to a rank bound to another rail may come back on a different interface.
        ip netns exec "$ns" sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
        # RDMA has no congestion window to rebuild after a pause between collectives; TCP does.
        ip netns exec "$ns" sysctl -qw net.ipv4.tcp_slow_start_after_idle=0
        link "$ns" mgmt "n${k}m" br-mgmt "10.100.0.$((k + 1))/24"
        for ((r = 0; r < rails; r++)); do
            link "$ns" "rail$r" "n${k}r$r" "br-rail$r" "10.$((r + 1)).0.$((k + 1))/24"
            shape "$ns" "rail$r" "$rate"
            shape "$fabric" "n${k}r$r" "$rate"
        done
    done
    mkdir -p "/run/$prefix" && echo "$nodes $rails $rate" >"/run/$prefix/shape"
    echo "rail-fabric: $nodes nodes x $rails rails at $rate per rail (namespaces $prefix-*)"
}

link() {  # namespace inside-name outside-name bridge address
    ip link add "$2-$$" type veth peer name "$3"
    ip link set "$2-$$" netns "$1"
    ip netns exec "$1" ip link set "$2-$$" name "$2"
    ip link set "$3" netns "$fabric"
    in_fabric ip link set "$3" master "$4" up
    ip netns exec "$1" ip addr add "$5" dev "$2"
    ip netns exec "$1" ip link set "$2" up
}

down() {
    local ns
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$prefix-" || true); do
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns delete "$ns"
    done
    rm -rf "/run/$prefix"
    [[ ${1:-} == quiet ]] || echo "rail-fabric: down"
}

status() {
    [[ -f /run/$prefix/shape ]] || { echo "rail-fabric: not up"; return 1; }
    read -r nodes rails rate <"/run/$prefix/shape"
    echo "rail-fabric: up, $nodes nodes x $rails rails at $rate per rail"
}

exec_in_node() {  # NODE CMD...: a node has its own hostname, so Open MPI sees separate hosts
    local node=$1
    shift
    [[ $node =~ ^rn[0-9]+$ ]] || die "no such node '$node' (rn0, rn1, ...)"
    ip netns list | grep -q "^$prefix-$node\b" || die "node '$node' is not up"
    exec ip netns exec "$prefix-$node" unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$node" "$@"
}

case "${1:-}" in
up) (($# == 4)) || die "usage: $0 up NODES RAILS RATE"; up "$2" "$3" "$4" ;;
down) down ;;
status) status ;;
exec) (($# >= 3)) || die "usage: $0 exec NODE CMD..."; shift; exec_in_node "$@" ;;
agent)  # Open MPI calls: agent [rsh options] HOST CMD (one shell string)
    shift
    while [[ ${1:-} == -* ]]; do shift; done
    host=$1
    shift
    exec_in_node "$host" sh -c "$*" ;;
*) die "usage: $0 up NODES RAILS RATE | down | status | exec NODE CMD... | agent HOST CMD..." ;;
esac
