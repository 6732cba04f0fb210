"""Apply a rank's binding (GPU, NIC of its rail, NUMA CPUs) before any communication library
starts: NCCL, UCX, Open MPI and Gloo read these variables when they initialise."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

from hpc.env import RankInfo
from hpc.fabric.topology import RankBinding, TopologyConfig, bind_local_rank, check_topology


def binding_for(topo: TopologyConfig, rank: RankInfo) -> RankBinding:
    check_topology(topo, rank.local_world_size)
    gpu, nic, rail, numa, cpus = bind_local_rank(topo, rank.local_rank, rank.local_world_size)
    return RankBinding(rank.rank, rank.node_rank, rank.local_rank, rank.host, gpu, nic, rail, numa, cpus)


def binding_environment(binding: RankBinding, topo: TopologyConfig, current: Mapping[str, str]) -> dict[str, str]:
    """Variables to set; a value the user or Slurm already chose is left alone."""
    wanted: dict[str, str] = {}
    visible = current.get("CUDA_VISIBLE_DEVICES")
    if binding.gpu is not None and (visible is None or "," in visible):  # unset, or several GPUs visible
        listed = visible.split(",") if visible else []  # GPU i of those visible: "2,3" gives local rank 0 GPU 2
        wanted["CUDA_VISIBLE_DEVICES"] = listed[binding.gpu].strip() if binding.gpu < len(listed) else str(binding.gpu)
    if binding.nic is not None:
        if topo.transport == "ib":
            wanted.update(NCCL_IB_HCA=f"={binding.nic}", UCX_NET_DEVICES=f"{binding.nic}:1")
        else:  # a TCP interface per rail (the emulated fabric)
            wanted.update(OMPI_MCA_btl_tcp_if_include=binding.nic, GLOO_SOCKET_IFNAME=binding.nic, NCCL_SOCKET_IFNAME=binding.nic)
    return {key: value for key, value in wanted.items() if key not in current or key == "CUDA_VISIBLE_DEVICES"}


def rank_threads(chosen: int | None, per_task: int | None, binding: RankBinding, local_ranks: int) -> int:
    """torch's threads for this rank: trainer.threads_per_rank when set, else the cores it owns:
    Slurm's --cpus-per-task, else the CPUs its binding pinned, else its share of the CPUs it may
    run on (shared with the node's other ranks). Call after apply_binding."""
    if chosen is not None:
        return max(1, chosen)
    if per_task is not None:
        return per_task
    available = os.sched_getaffinity(0)
    if binding.cpus and available <= set(binding.cpus):  # pinned to its own CPUs
        return len(available)
    return max(1, len(available) // max(1, local_ranks))


def apply_binding(binding: RankBinding, topo: TopologyConfig, environ: MutableMapping[str, str] = os.environ) -> str:
    """Set the variables and the CPU affinity; returns the line each rank logs."""
    environ.update(binding_environment(binding, topo, environ))
    available = os.sched_getaffinity(0)
    pinned = sorted(set(binding.cpus) & available)
    if pinned:
        os.sched_setaffinity(0, pinned)
    cpus = (
        f"{len(pinned)} CPUs {pinned[0]}-{pinned[-1]}"
        if pinned
        else "CPUs unchanged" + (f" (declared {binding.cpus[0]}-{binding.cpus[-1]} not on this machine)" if binding.cpus else "")
    )
    return (
        f"binding: gpu {binding.gpu if binding.gpu is not None else '-'}, nic {binding.nic or '-'}"
        f" (rail {binding.rail if binding.rail is not None else '-'}), numa {binding.numa}, {cpus}"
    )
