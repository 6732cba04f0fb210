"""The backend table (collectives/backends.py, issue 47): one entry per backend, read by the
login node's checks, the rank's start and the gradient sync; a new backend is one entry."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from torch import nn

from collectives import backends, init_collectives
from collectives.backends import BACKEND_TABLE, BACKENDS, Backend, UnknownBackend, backend_of, resolve_backend
from collectives.base import SingleProcess
from collectives.config import DDP_BUCKET_MB, ENGINE_BUCKET_MB, SHARDINGS, CommConfig
from collectives.gradsync import LocalGradients, ZeroSync, build_gradient_sync
from hpc.config.schema import ClusterConfig, JobConfig, ResourcesConfig
from hpc.config.validate import check_backend
from hpc.env import RankInfo
from hpc.errors import UserError

SLURM = ClusterConfig(name="sim", launcher="slurm", partition="debug")


def job(backend: str, gpus: int = 0, sharding: str = "none", compression: str = "none") -> JobConfig:
    comm = CommConfig(backend=backend, sharding=sharding, compression=compression)
    return JobConfig(cluster=SLURM, resources=replace(ResourcesConfig(), gpus_per_task=gpus), comm=comm)


def test_auto_resolves_the_same_for_the_login_node_and_the_rank():
    assert backend_of(CommConfig(backend="auto"), 0).name == "mpi"
    on_gpus = resolve_backend(CommConfig(backend="auto"), 1)
    assert (on_gpus.backend, on_gpus.bucket_mb) == ("nccl", DDP_BUCKET_MB) and backend_of(CommConfig(backend="auto"), 1) is BACKEND_TABLE["nccl"]
    assert resolve_backend(CommConfig(backend="auto", bucket_mb=8.0), 1).bucket_mb == 8.0  # a bucket the user chose stays
    assert resolve_backend(CommConfig(backend="gloo"), 1).backend == "gloo" and ENGINE_BUCKET_MB != DDP_BUCKET_MB
    assert BACKENDS == ("auto", "mpi", "gloo", "nccl", "horovod")


@pytest.mark.parametrize("name", list(BACKEND_TABLE))
def test_every_sharding_the_login_node_accepts_is_one_the_table_grants(name):
    """Validation and the table agree for every backend and sharding: what the entry lists passes
    the backend's own check (on the hardware it trains on), everything else is refused."""
    entry = BACKEND_TABLE[name]
    gpus = 1 if entry.trains_on == "gpu" else 0
    for sharding in SHARDINGS:
        config = job(name, gpus, sharding)
        if entry.package is not None and importlib.util.find_spec(entry.package) is None:
            continue  # refused for the package, whatever the sharding
        if sharding in entry.shardings:
            check_backend(config)
        else:
            with pytest.raises(UserError, match=f"comm.sharding={sharding} "):
                check_backend(config)


def test_a_new_backend_is_one_entry(monkeypatch):
    """An entry named `ucc` (a torch.distributed process group on CPUs, replicated or FSDP2):
    the login node accepts what it lists and refuses the rest naming where that runs, and the
    gradient sync builds from it, with no other change."""
    ucc = Backend("ucc", "cpu", True, "torch.distributed", ("none", "full"), ("none", "fp16"), False, "UCC")
    monkeypatch.setitem(BACKEND_TABLE, "ucc", ucc)
    check_backend(job("ucc"))
    check_backend(job("ucc", sharding="full"))
    with pytest.raises(
        UserError,
        match=r"comm.sharding=optimizer runs on the toolkit's engine: use comm=mpi \(comm=ucc trains replicated.*full shards on gloo and nccl and ucc",
    ):
        check_backend(job("ucc", sharding="optimizer"))
    with pytest.raises(UserError, match="comm.compression=bf16 is not offered by UCC; use none or fp16 with comm=ucc"):
        check_backend(job("ucc", compression="bf16"))
    with pytest.raises(UserError, match="comm=ucc trains on the CPU, but the job asks for 1 GPU"):
        check_backend(job("ucc", gpus=1))
    model = nn.Linear(2, 1)
    assert isinstance(build_gradient_sync(model, torch.optim.SGD(model.parameters(), lr=0.1), SingleProcess(), CommConfig(backend="ucc"), 1), LocalGradients)
    with pytest.raises(ValueError, match="comm.sharding=gradients runs on the toolkit's engine: use comm=mpi"):
        build_gradient_sync(model, torch.optim.SGD(model.parameters(), lr=0.1), SingleProcess(), CommConfig(backend="ucc", sharding="gradients"), 1)
    assert backends.offering("shardings", "full") == ["gloo", "nccl", "ucc"]


def test_the_gradient_sync_and_the_start_refuse_what_the_table_does_not_hold():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert isinstance(build_gradient_sync(model, optimizer, SingleProcess(), CommConfig(backend="mpi", sharding="optimizer"), 1), ZeroSync)
    with pytest.raises(ValueError, match="comm.sharding=full runs FSDP2 on torch.distributed: use comm=gloo .CPUs. or comm=nccl .GPUs., not comm=horovod"):
        build_gradient_sync(model, optimizer, SingleProcess(), CommConfig(backend="horovod", sharding="full"), 1)
    with pytest.raises(UnknownBackend, match="comm.backend='auto' is not one of mpi, gloo, nccl, horovod .resolve comm=auto first"):
        build_gradient_sync(model, optimizer, SingleProcess(), CommConfig(backend="auto"), 1)
    place = RankInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1, hosts=("h",), launcher="single")
    with pytest.raises(UnknownBackend, match="comm.backend='ucx' is not one of mpi, gloo, nccl, horovod$"):
        init_collectives(CommConfig(backend="ucx"), place)


def test_the_table_s_entries_agree_with_what_their_libraries_do_and_cannot_be_changed_in_place():
    # torch.distributed's process groups meet at MASTER_ADDR:MASTER_PORT; MPI and Horovod start
    # from the MPI world. torch's SyncBatchNorm runs on GPUs only. A rank reads the same entry the
    # login node checked: an entry is frozen.
    meets = {name for name, entry in BACKEND_TABLE.items() if entry.rendezvous}
    assert meets == {name for name, entry in BACKEND_TABLE.items() if entry.family == "torch.distributed"} == {"gloo", "nccl"}
    on_gpus = {name for name, entry in BACKEND_TABLE.items() if entry.trains_on == "gpu"}
    assert {name for name, entry in BACKEND_TABLE.items() if entry.sync_batchnorm} == on_gpus
    with pytest.raises(AttributeError, match="cannot assign to field 'trains_on'"):
        BACKEND_TABLE["mpi"].trains_on = "gpu"  # type: ignore[misc]
