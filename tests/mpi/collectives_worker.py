"""Run under `mpirun -np N`: checks the mpi backend against values every rank can compute.

    collectives_worker.py [all]                 every algorithm x dtype x op x count, the other collectives,
                                                a late peer waited for without spinning
    collectives_worker.py auto PER_NODE NODES   which algorithm `auto` runs at realistic sizes when ranks
                                                are grouped PER_NODE to a node (0: the launcher's layout);
                                                NODES: the hierarchy expected (0: none, unequal nodes)
    collectives_worker.py tuned PER_NODE NODES CACHE_DIR
                                                auto tuned on these ranks: one table on every rank,
                                                cached, pinned, and the fastest entry run
    collectives_worker.py optimizer             tests/mpi/optimizer_worker.py's checks

Plans separated by `+` run one after another in one launch (`all + optimizer`). Exits non-zero
(failing the pytest that launched it) on the first mismatch.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from collectives import algorithms, init_collectives
from collectives.base import allreduce_sums, broadcast_module
from collectives.config import ALGORITHMS, CommConfig
from collectives.mpi import MPI_MAX_BYTES, RHD_MAX_BYTES, choose_algorithm
from hpc.env import RankInfo
from tests.support.worker import run_worker
from trainers.data.sampler import ShardSampler
from trainers.reporting import metricnames


def rank_values(rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(count, dtype=torch.float64) * (rank + 1) + rank).to(dtype)


COUNTS = (0, 1, 2, 3, 5, 1000, 4099, 70_001)  # 0, 1, odd, not divisible by any world size, > 256 KiB
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


def check_algorithms(info: RankInfo) -> None:
    """Every algorithm x dtype x op x count against a result each rank computes alone."""
    world = info.world_size
    for algorithm in ALGORITHMS:
        per_node = 2 if algorithm == "hierarchical" and world % 2 == 0 else None
        comm = init_collectives(CommConfig(algorithm=algorithm, ranks_per_node=per_node), info)
        for dtype in DTYPES:
            exact = dtype not in (torch.float16, torch.bfloat16)
            for count in COUNTS:
                if dtype in (torch.float16, torch.bfloat16) and count > 5000:
                    continue  # sums of large values lose precision in half types; covered small
                expected = sum(rank_values(r, count, torch.float64) for r in range(world))
                for op in ("sum", "max", "min", "avg"):
                    if op == "avg" and not dtype.is_floating_point:
                        continue
                    buffer = rank_values(comm.rank, count, dtype)
                    comm.allreduce_(buffer, op=op)
                    want = (
                        {
                            "sum": expected,
                            "avg": expected / world,
                            "max": rank_values(world - 1, count, torch.float64),
                            "min": rank_values(0, count, torch.float64),
                        }[op]
                        .to(dtype)
                        .to(torch.float64)
                    )
                    got = buffer.to(torch.float64)
                    rtol = 0.0 if exact and op != "avg" else 1e-6 if dtype in (torch.float32, torch.float64) else 2e-2
                    assert got.shape == want.shape and torch.allclose(got, want, rtol=rtol, atol=rtol), (algorithm, dtype, count, op)
        comm.close()


def check_other_collectives(comm) -> None:
    world, rank = comm.world_size, comm.rank
    for count in (0, 1, 7, 100_003):  # tree below 256 KiB, scatter + allgather above
        for root in {0, world - 1}:
            buffer = rank_values(rank, count, torch.float32) if rank == root else torch.zeros(count)
            comm.broadcast_(buffer, root)
            assert torch.equal(buffer, rank_values(root, count, torch.float32)), ("broadcast", count, root)
        gathered = comm.allgather(torch.full((count,), float(rank)))
        assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(count)), ("allgather", count)
        mine = comm.reduce_scatter(rank_values(rank, count, torch.float64), op="sum")
        full = sum(rank_values(r, count, torch.float64) for r in range(world))
        assert torch.equal(mine, full[count * rank // world : count * (rank + 1) // world]), ("reduce_scatter", count)


def check_metric_names(comm) -> None:
    """Every rank's metric names through the backend's own collectives (trainers.reporting.metricnames):
    names of different lengths, non-ASCII, and a rank with none."""
    last = comm.world_size - 1
    mine = None if comm.rank == last else tuple(f"recall_{c}" for c in range(comm.rank + 1)) + ("perplexité",)
    expected = [None if r == last else tuple(f"recall_{c}" for c in range(r + 1)) + ("perplexité",) for r in range(comm.world_size)]
    assert metricnames.exchange(comm, mine) == expected, "metric names exchange"


def seeded_model(seed: int) -> nn.Module:
    """A model whose parameters and BatchNorm statistics all depend on the seed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2.0)
    return model


def flat_state(model: nn.Module) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in [*model.parameters(), model[1].running_mean, model[1].running_var]])


def check_broadcast_module(comm, root: int) -> None:
    """Different parameters and buffers on every rank; after the broadcast, root's everywhere."""
    model = seeded_model(100 + comm.rank)
    roots = flat_state(seeded_model(100 + root))  # what root started from, rebuilt locally
    assert comm.rank == root or not torch.equal(flat_state(model), roots)  # the broadcast has work to do
    broadcast_module(comm, model, root)
    assert torch.equal(flat_state(model), roots), ("broadcast_module", comm.rank, root)


# --- which algorithm auto runs ----------------------------------------------------------------


RECORDED: list[str] = []  # record_algorithms' list, one per launch


def record_algorithms() -> list[str]:
    """Wrap our allreduce algorithms so that each call is listed; an allreduce that calls none
    of them went to MPI_Allreduce. hierarchical calls ring inside: the first entry is the choice."""
    RECORDED.clear()
    if getattr(algorithms.ring_allreduce, "recorded", False):
        return RECORDED  # wrapped by an earlier plan of this launch
    for name in ("ring_allreduce", "rhd_allreduce", "hierarchical_allreduce"):

        def counted(*args, _run=getattr(algorithms, name), _name=name.removesuffix("_allreduce"), **kwargs):
            RECORDED.append(_name)
            return _run(*args, **kwargs)

        counted.recorded = True  # type: ignore[attr-defined]
        setattr(algorithms, name, counted)
    return RECORDED


def large_values(rank: int, count: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Small integers: sums are exact in any order, however long the buffer (below 2048 in float16)."""
    period = 997 if dtype == torch.float32 else 16
    return ((torch.arange(count) % period) * (rank + 1) + rank).to(dtype)


AUTO_CASES = (  # (bytes per rank, dtype, auto's choice where there is no hierarchy)
    (1 << 10, torch.float32, "mpi"),
    (MPI_MAX_BYTES - 4, torch.float32, "mpi"),
    (1 << 10, torch.float16, "rhd"),  # Open MPI has no float16 sum
    (MPI_MAX_BYTES, torch.float32, "rhd"),
    (2 << 20, torch.float32, "rhd"),
    (RHD_MAX_BYTES, torch.float32, "ring"),  # 4 MiB: a realistic gradient bucket
    ((6 << 20) + 4, torch.float32, "ring"),  # 1572865 elements: uneven chunks on 2, 3 or 6 ranks
)


def check_auto_choice(info: RankInfo, per_node: int, nodes: int) -> None:
    """Untuned (comm.autotune=false): the fallback crossovers."""
    calls = record_algorithms()
    world = info.world_size
    comm = init_collectives(CommConfig(algorithm="auto", autotune=False, ranks_per_node=per_node or None), info)
    for nbytes, dtype, flat_choice in AUTO_CASES:
        expected = "hierarchical" if flat_choice == "ring" and nodes > 1 else flat_choice
        assert choose_algorithm(nbytes, "auto", dtype, nodes) == expected, ("choose_algorithm", nbytes, dtype, nodes)
        count = nbytes // torch.tensor([], dtype=dtype).element_size()
        buffer = large_values(comm.rank, count, dtype)
        calls.clear()
        comm.allreduce_(buffer, op="sum")
        ran = calls[0] if calls else "mpi"
        assert ran == expected, ("auto ran", ran, "expected", expected, nbytes, dtype, world, per_node)
        want = sum(large_values(r, count, dtype).to(torch.float64) for r in range(world)).to(dtype)
        assert torch.equal(buffer, want), ("auto result", nbytes, dtype)
    # Asked for explicitly: hierarchical where nodes are equal, auto's choice where they are not.
    for count, fallback in ((5, "mpi"), (1_100_003, "ring")):
        buffer = large_values(comm.rank, count)
        calls.clear()
        comm.allreduce_async(buffer, op="avg", algorithm="hierarchical").wait()
        assert (calls[0] if calls else "mpi") == ("hierarchical" if nodes else fallback), ("hierarchical asked", count, calls)
        want = sum(large_values(r, count).to(torch.float64) for r in range(world)) / world
        assert torch.allclose(buffer.to(torch.float64), want, rtol=1e-6, atol=0), ("hierarchical result", count)
    comm.close()
    if comm.rank == 0:
        print(f"auto ok on {world} ranks, {per_node or 'launcher'} per node, {nodes} nodes")


def check_tuned_choice(info: RankInfo, per_node: int, nodes: int, cache_dir: str) -> None:
    """Measured once, then cached; a pinned table wins over the cache; every rank holds the same
    table; and the engine runs the table's fastest eligible algorithm, with a correct sum."""
    cfg = CommConfig(algorithm="auto", ranks_per_node=per_node or None, tuning_cache=cache_dir)
    first = init_collectives(cfg, info)
    assert first.tuned_from.startswith("measured"), first.tuned_from
    from mpi4py import MPI

    tables = MPI.COMM_WORLD.allgather(first.table.to_json())
    assert len(set(tables)) == 1, "ranks hold different tables"
    candidates = set(first.table.seconds)
    assert candidates == {"mpi", "rhd", "ring"} | ({"hierarchical"} if nodes > 1 else set()), candidates
    first.close()
    again = init_collectives(cfg, info)
    assert again.tuned_from.startswith("cached"), again.tuned_from
    assert again.table == first.table
    again.close()
    pinned = Path(cache_dir) / "job" / "allreduce-table.json"
    third = init_collectives(cfg, info, pinned_table=pinned)  # first start of a job: pins the cached table
    assert third.tuned_from.startswith("cached") and third.table == first.table
    third.close()
    if info.rank == 0:
        assert pinned.exists()
        for cached in Path(cache_dir).glob("allreduce-*.json"):
            cached.write_text("{ not json")  # the shared cache is damaged: the job's own copy still holds
    MPI.COMM_WORLD.Barrier()
    resumed = init_collectives(cfg, info, pinned_table=pinned)
    assert resumed.tuned_from.startswith("pinned") and resumed.table == first.table, resumed.tuned_from
    calls = record_algorithms()
    count = (1 << 20) // 4
    for favourite in sorted(candidates):
        for dtype in (torch.float32, torch.bfloat16):
            seconds = {name: tuple(1.0 if name == favourite else 2.0 + i for i, _ in enumerate(first.table.sizes)) for name in candidates}
            resumed.table = replace(first.table, seconds=seconds)
            expected = favourite if favourite != "mpi" or dtype == torch.float32 else "rhd"  # a tie: the first eligible
            buffer = large_values(resumed.rank, count, dtype)
            calls.clear()
            resumed.allreduce_(buffer, op="sum")
            assert (calls[0] if calls else "mpi") == expected, ("tuned auto ran", calls[:1], "expected", expected, dtype)
            want = sum(large_values(r, count, dtype).to(torch.float64) for r in range(info.world_size)).to(dtype)
            assert torch.equal(buffer, want), ("tuned result", favourite, dtype)
    resumed.close()
    if info.rank == 0:
        print(f"tuned ok on {info.world_size} ranks")


def check_a_late_peer_is_waited_for_without_a_core(comm) -> None:
    """The last rank comes 0.5 s late to a barrier, a vote-sized allreduce and a ring allreduce;
    the others' CPU time while they wait stays a small part of it (a spinning MPI wait uses as
    much CPU as the wait is long; collectives.waits polls between sleeps)."""
    late = comm.world_size - 1
    for what, collective in (
        ("barrier", comm.barrier),
        ("vote", lambda: comm.allreduce_(torch.ones(4), op="max")),
        ("ring", lambda: comm.allreduce_async(torch.ones(1 << 18), algorithm="ring").wait()),
    ):
        comm.barrier()
        if comm.rank == late:
            time.sleep(0.5)
        wall, cpu = time.perf_counter(), time.process_time()
        collective()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if comm.rank != late:
            assert wall > 0.25 and cpu < 0.25 * wall, (what, "waited", round(wall, 3), "s using", round(cpu, 3), "s of CPU")


def check_everything(info: RankInfo) -> None:
    """Every algorithm, the other collectives, broadcast_module, disjoint shards, metric names
    and a late peer's wait."""
    check_algorithms(info)
    comm = init_collectives(CommConfig(), info)
    world = comm.world_size
    check_other_collectives(comm)

    for root in sorted({0, world - 1}):
        check_broadcast_module(comm, root)

    # The shards each rank reads are disjoint across ranks.
    sampler = ShardSampler(100, 8, comm.rank, world, seed=3)
    mine = np.zeros(100, dtype=np.int64)
    for batch in sampler.batches(epoch=2):
        mine[batch] += 1
    counts = torch.from_numpy(mine)
    comm.allreduce_(counts, op="sum")
    assert counts.max() == 1 and int(counts.sum()) == sampler.steps_per_epoch * 8 * world

    total, _ = allreduce_sums(comm, [1.0, 0.0])
    assert total == world
    check_metric_names(comm)
    check_a_late_peer_is_waited_for_without_a_core(comm)
    comm.barrier()
    comm.close()
    if comm.rank == 0:
        print(f"collectives ok on {world} ranks")


def main() -> None:
    """The plans named on the command line, separated by `+`, one after another in this launch
    (a rank's start costs seconds of CPU; one launch per world size runs every check for it)."""
    info = RankInfo.from_env(os.environ)
    plans: list[list[str]] = [[]]
    for arg in sys.argv[1:] or ["all"]:
        if arg == "+":
            plans.append([])
        else:
            plans[-1].append(arg)
    for name, *args in plans:
        if name == "all":
            check_everything(info)
        elif name == "auto":
            check_auto_choice(info, int(args[0]), int(args[1]))
        elif name == "tuned":
            check_tuned_choice(info, int(args[0]), int(args[1]), args[2])
        elif name == "optimizer":
            from tests.mpi.optimizer_worker import main as check_optimizer

            check_optimizer()
        else:
            raise SystemExit(f"collectives_worker.py: unknown plan {name!r}")


if __name__ == "__main__":
    run_worker(main)
