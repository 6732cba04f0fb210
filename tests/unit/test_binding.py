import os
from dataclasses import replace

import pytest

from hpc.env import RankInfo
from hpc.errors import UserError
from hpc.fabric.topology import TopologyConfig
from hpc.rank.binding import apply_binding, binding_environment, binding_for

DGX = TopologyConfig(
    name="dgx",
    gpus_per_node=8,
    nics=[f"mlx5_{i}" for i in range(8)],
    rail_of_gpu=list(range(8)),
    numa_of_nic=[0, 0, 0, 0, 1, 1, 1, 1],
    numa_cpus=["0-55", "56-111"],
)


def rank(local_rank: int, local_world: int = 8) -> RankInfo:
    return RankInfo(8 + local_rank, local_rank, 16, local_world, 1, 2, ("n1", "n2"), "slurm")


def test_ib_rail_binding_sets_gpu_and_hca_variables():
    b = binding_for(DGX, rank(5))
    assert (b.gpu, b.nic, b.rail, b.numa, b.host) == (5, "mlx5_5", 5, 1, "n2")
    env = binding_environment(b, DGX, {})
    assert env == {"CUDA_VISIBLE_DEVICES": "5", "NCCL_IB_HCA": "=mlx5_5", "UCX_NET_DEVICES": "mlx5_5:1"}


def test_tcp_rails_name_the_interface_and_user_settings_win():
    tcp = replace(DGX, nics=[f"rail{i}" for i in range(8)], transport="tcp")
    env = binding_environment(binding_for(tcp, rank(2)), tcp, {"GLOO_SOCKET_IFNAME": "eth9", "CUDA_VISIBLE_DEVICES": "3"})
    assert env == {"OMPI_MCA_btl_tcp_if_include": "rail2", "NCCL_SOCKET_IFNAME": "rail2"}  # Slurm's single GPU kept


def test_a_rank_binds_its_gpu_among_those_the_job_was_given():
    local = TopologyConfig(name="cpu", gpus_per_node=2)  # a local machine's GPUs, found by the launcher (hpc.config.local_gpus)
    assert binding_environment(binding_for(local, rank(1, 2)), local, {"CUDA_VISIBLE_DEVICES": "2,3"}) == {"CUDA_VISIBLE_DEVICES": "3"}
    assert binding_environment(binding_for(local, rank(1, 2)), local, {"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}) == {"CUDA_VISIBLE_DEVICES": "GPU-bb"}
    assert binding_environment(binding_for(local, rank(1, 2)), local, {}) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_more_local_ranks_than_gpus_is_refused():
    with pytest.raises(UserError, match="8 GPUs per node but resources.tasks_per_node=9"):
        binding_for(DGX, rank(0, local_world=9))


def test_affinity_is_pinned_to_the_declared_cpus_that_exist():
    available = sorted(os.sched_getaffinity(0))
    topo = TopologyConfig(numa_cpus=[str(available[0]), "100000"])  # NUMA 1 does not exist here
    before = os.sched_getaffinity(0)
    try:
        line = apply_binding(binding_for(topo, rank(0, local_world=2)), topo, environ={})
        assert os.sched_getaffinity(0) == {available[0]} and "1 CPUs" in line
        line = apply_binding(binding_for(topo, rank(1, local_world=2)), topo, environ={})
        assert "CPUs unchanged (declared 100000-100000 not on this machine)" in line
    finally:
        os.sched_setaffinity(0, before)


def test_a_rank_gets_as_many_torch_threads_as_cores_it_owns():
    from hpc.env import cpus_per_task
    from hpc.rank.binding import rank_threads

    available = sorted(os.sched_getaffinity(0))
    unbound = binding_for(TopologyConfig(), rank(0, local_world=2))
    per_task = cpus_per_task({"SLURM_JOB_ID": "5", "SLURM_CPUS_PER_TASK": "8"})
    assert rank_threads(3, per_task, unbound, 2) == 3  # trainer.threads_per_rank wins
    assert rank_threads(None, per_task, unbound, 2) == 8  # Slurm gave the task 8 CPUs
    assert cpus_per_task({}) is None and cpus_per_task({"SLURM_CPUS_PER_TASK": "0"}) is None
    assert rank_threads(None, None, unbound, 1) == len(available)  # a lone rank owns every CPU it may run on
    assert rank_threads(None, None, unbound, len(available) * 4) == 1  # oversubscribed: never 0
    topo = TopologyConfig(numa_cpus=[",".join(map(str, available))])
    before = os.sched_getaffinity(0)
    try:
        pinned = binding_for(topo, rank(0, local_world=2))
        apply_binding(pinned, topo, environ={})
        owned = len(os.sched_getaffinity(0))
        assert owned == len(pinned.cpus) < len(available) or len(available) == 1  # its share of the NUMA node's CPUs
        assert rank_threads(None, None, pinned, 2) == owned  # pinned: every CPU left to it is its own, not shared
    finally:
        os.sched_setaffinity(0, before)
