"""Node and cluster topology, and rail-aware rank mapping. Pure functions, no torch.

A node has G GPUs and NICs; GPU i hangs off NIC `rail_of_gpu[i]` (rail i on rail-optimized
clusters), every device sits on a NUMA node, and every NUMA node owns a CPU list. local_rank i
is bound to GPU i (or to nothing on a CPU-only node), the NIC of its rail, and the CPUs of that
NIC's NUMA node.

The cluster's switch tree comes from Slurm's topology.conf (SwitchName=... Switches=... /
Nodes=...). Ordering a job's nodes so that ring neighbours share a leaf switch keeps most ring
traffic off the spine; `ring_hops` counts the neighbour pairs whose path crosses switches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import hostlist

from hpc.errors import UserError

TRANSPORTS = ("ib", "tcp")


@dataclass
class TopologyConfig:
    """One node's hardware: GPU i uses NIC rail_of_gpu[i]; NIC j sits on NUMA numa_of_nic[j];
    NUMA node k owns the CPUs numa_cpus[k] ('0-55,112-167'). Empty lists: not known."""

    name: str = "cpu"
    gpus_per_node: int = 0
    nics: list[str] = field(default_factory=list)
    rail_of_gpu: list[int] = field(default_factory=list)
    numa_of_nic: list[int] = field(default_factory=list)
    numa_cpus: list[str] = field(default_factory=list)
    transport: str = "ib"  # one of TRANSPORTS. ib: nics are HCAs (NCCL_IB_HCA, UCX); tcp: interfaces


@dataclass(frozen=True)
class RankBinding:
    rank: int
    node_rank: int
    local_rank: int
    host: str
    gpu: int | None
    nic: str | None
    rail: int | None
    numa: int
    cpus: tuple[int, ...]


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11), as in /sys and numactl."""
    cpus: list[int] = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UserError(f"malformed CPU list {text!r} (expected e.g. 0-3,8,10-11)") from None
    return tuple(cpus)


def check_topology(topo: TopologyConfig, tasks_per_node: int) -> None:
    """Refuse a topology that cannot host `tasks_per_node` ranks, naming what is missing."""
    if topo.transport not in TRANSPORTS:
        raise UserError(f"topology.transport={topo.transport!r} is not one of {', '.join(TRANSPORTS)}")
    if topo.gpus_per_node and tasks_per_node > topo.gpus_per_node:
        raise UserError(f"topology={topo.name} has {topo.gpus_per_node} GPUs per node but resources.tasks_per_node={tasks_per_node}")
    if len(topo.rail_of_gpu) not in (0, topo.gpus_per_node):
        raise UserError(f"topology={topo.name}: rail_of_gpu lists {len(topo.rail_of_gpu)} GPUs, gpus_per_node is {topo.gpus_per_node}")
    rails = set(topo.rail_of_gpu)
    if rails and (min(rails) < 0 or max(rails) >= len(topo.nics)):
        raise UserError(f"topology={topo.name}: rail_of_gpu uses rails {sorted(rails)} but only {len(topo.nics)} NICs are listed")
    if len(topo.numa_of_nic) not in (0, len(topo.nics)):
        raise UserError(f"topology={topo.name}: numa_of_nic has {len(topo.numa_of_nic)} entries for {len(topo.nics)} NICs")
    for numa in sorted(set(topo.numa_of_nic) | set(range(len(topo.numa_cpus)))):
        if numa >= len(topo.numa_cpus) or not parse_cpu_list(topo.numa_cpus[numa]):
            raise UserError(f"topology={topo.name}: NUMA node {numa} has no CPUs (numa_cpus)")


def _rail_of(topo: TopologyConfig, local_rank: int) -> int | None:
    if not topo.nics:
        return None
    if topo.gpus_per_node and topo.rail_of_gpu:
        return topo.rail_of_gpu[local_rank]
    return local_rank % len(topo.nics)


def _numa_of(topo: TopologyConfig, local_rank: int, tasks_per_node: int) -> int:
    rail = _rail_of(topo, local_rank)
    if rail is not None:
        return topo.numa_of_nic[rail] if topo.numa_of_nic else 0
    return local_rank * len(topo.numa_cpus) // max(tasks_per_node, 1) if topo.numa_cpus else 0


def bind_local_rank(topo: TopologyConfig, local_rank: int, tasks_per_node: int) -> tuple[int | None, str | None, int | None, int, tuple[int, ...]]:
    """(gpu, nic, rail, numa, cpus) for one local rank."""
    rail = _rail_of(topo, local_rank)
    numa = _numa_of(topo, local_rank, tasks_per_node)
    numa_cpus = parse_cpu_list(topo.numa_cpus[numa]) if topo.numa_cpus else ()
    # Ranks sharing a NUMA node split its CPUs rather than all pinning to every one of them.
    sharing = [r for r in range(tasks_per_node) if _numa_of(topo, r, tasks_per_node) == numa]
    share = len(numa_cpus) // len(sharing)
    index = sharing.index(local_rank)
    cpus = numa_cpus[index * share : (index + 1) * share] if share else numa_cpus
    gpu = local_rank if topo.gpus_per_node else None
    return gpu, (topo.nics[rail] if rail is not None else None), rail, numa, cpus


def map_ranks(topo: TopologyConfig, hosts: Sequence[str], tasks_per_node: int) -> list[RankBinding]:
    """Block mapping (ranks of a node are consecutive), each local rank bound to its rail."""
    check_topology(topo, tasks_per_node)
    bindings = []
    for node_rank, host in enumerate(hosts):
        for local_rank in range(tasks_per_node):
            gpu, nic, rail, numa, cpus = bind_local_rank(topo, local_rank, tasks_per_node)
            bindings.append(RankBinding(node_rank * tasks_per_node + local_rank, node_rank, local_rank, host, gpu, nic, rail, numa, cpus))
    return bindings


# --- the switch tree ------------------------------------------------------------------------


@dataclass(frozen=True)
class SwitchTree:
    leaf_of: dict[str, str]  # host -> its leaf switch
    parent_of: dict[str, str]  # switch -> the switch above it

    def path_to_root(self, switch: str) -> list[str]:
        path = [switch]
        while path[-1] in self.parent_of:
            path.append(self.parent_of[path[-1]])
            if len(path) > 64:
                raise UserError("topology.conf has a switch cycle")
        return path

    def hops(self, a: str, b: str) -> int:
        """Switch-to-switch links between two hosts' leaves (0: same leaf)."""
        if a == b or self.leaf_of.get(a) == self.leaf_of.get(b):
            return 0
        up_a, up_b = self.path_to_root(self.leaf_of[a]), self.path_to_root(self.leaf_of[b])
        common = next((i, up_b.index(s)) for i, s in enumerate(up_a) if s in up_b)
        return common[0] + common[1]


def parse_topology_conf(text: str) -> SwitchTree:
    """Slurm topology.conf (topology/tree): SwitchName=s Nodes=hostlist | Switches=hostlist."""
    leaf_of: dict[str, str] = {}
    parent_of: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if not sep or not value:
                raise UserError(f"topology.conf line {number}: expected Key=Value, got {token!r}")
            fields[key.lower()] = value
        if "switchname" not in fields:
            raise UserError(f"topology.conf line {number}: no SwitchName")
        name = fields["switchname"]
        try:
            for host in hostlist.expand_hostlist(fields["nodes"]) if "nodes" in fields else []:
                leaf_of[host] = name
            for child in hostlist.expand_hostlist(fields["switches"]) if "switches" in fields else []:
                parent_of[child] = name
        except hostlist.BadHostlist as err:
            raise UserError(f"topology.conf line {number}: bad host list ({err})") from None
    if not leaf_of:
        raise UserError("topology.conf lists no Nodes= under any switch")
    return SwitchTree(leaf_of, parent_of)


def ring_hops(tree: SwitchTree, hosts: Sequence[str]) -> int:
    """Inter-switch links crossed by all neighbour pairs of the ring over `hosts`."""
    if len(hosts) < 2:
        return 0
    return sum(tree.hops(hosts[i], hosts[(i + 1) % len(hosts)]) for i in range(len(hosts)))


def order_for_ring(tree: SwitchTree, hosts: Sequence[str]) -> list[str]:
    """Group hosts by leaf switch, leaves in the order of the switch tree (leaves under the same
    parent adjacent), hosts within a leaf in their original order: ring neighbours share a leaf
    except at the few leaf boundaries."""
    unknown = [h for h in hosts if h not in tree.leaf_of]
    if unknown:
        raise UserError(f"hosts {', '.join(unknown[:5])} are not under any switch in topology.conf")

    def key(host: str) -> tuple[list[str], int]:
        return (list(reversed(tree.path_to_root(tree.leaf_of[host]))), list(hosts).index(host))

    return sorted(hosts, key=key)


def ring_positions(topology_conf_text: str, hosts: Sequence[str]) -> tuple[dict[str, int], str]:
    """Each host's place in the switch-ordered ring, and a line saying what ordering gained."""
    tree = parse_topology_conf(topology_conf_text)
    ordered = order_for_ring(tree, hosts)
    line = f"ring over {len(hosts)} nodes ordered by switch: {ring_hops(tree, hosts)} inter-switch hops as allocated, {ring_hops(tree, ordered)} now"
    return {host: i for i, host in enumerate(ordered)}, line


@dataclass(frozen=True)
class Placement:
    leaves: list[str]  # the leaf switches to use, fullest first
    hosts: list[str]  # the nodes, in ring order

    @property
    def switches(self) -> int:
        return len(self.leaves)


def plan_placement(tree: SwitchTree, nodes: int, available: Sequence[str] | None = None) -> Placement:
    """The fewest leaf switches that hold `nodes` of the available hosts (one node needs one
    leaf): take the fullest leaves first, preferring leaves under one parent switch, so the
    request can be sent as `--switches=<count>`."""
    hosts = list(available) if available is not None else list(tree.leaf_of)
    by_leaf: dict[str, list[str]] = {}
    for host in hosts:
        if host not in tree.leaf_of:
            raise UserError(f"host {host} is not under any switch in topology.conf")
        by_leaf.setdefault(tree.leaf_of[host], []).append(host)
    if nodes < 1 or nodes > len(hosts):
        raise UserError(f"cannot place {nodes} nodes on {len(hosts)} available hosts")
    # Fullest leaf first; among equals, leaves sharing a parent with the fullest come first.
    first = max(by_leaf, key=lambda leaf: (len(by_leaf[leaf]), leaf))
    parent = tree.parent_of.get(first)
    order = sorted(by_leaf, key=lambda leaf: (-len(by_leaf[leaf]), tree.parent_of.get(leaf) != parent, leaf))
    leaves: list[str] = []
    chosen: list[str] = []
    for leaf in order:
        if len(chosen) >= nodes:
            break
        leaves.append(leaf)
        chosen.extend(by_leaf[leaf][: nodes - len(chosen)])
    return Placement(leaves, order_for_ring(tree, chosen))


# --- python -m hpc.topology show | place | detect ---------------------------------------------


def render_mapping(bindings: Sequence[RankBinding]) -> str:
    rows = ["rank  node  local  host            gpu  nic       rail  numa  cpus"]
    for b in bindings:
        cpus = f"{b.cpus[0]}-{b.cpus[-1]}" if b.cpus and b.cpus == tuple(range(b.cpus[0], b.cpus[-1] + 1)) else ",".join(map(str, b.cpus)) or "-"
        rows.append(
            f"{b.rank:<5d} {b.node_rank:<5d} {b.local_rank:<6d} {b.host:<15s} {_dash(b.gpu):<4s} {_dash(b.nic):<9s} {_dash(b.rail):<5s} {b.numa:<5d} {cpus}"
        )
    return "\n".join(rows)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
