"""The `mpi` backend: the toolkit's own collective engine on mpi4py.

One communication thread runs every asynchronous collective in submission order (so ranks
always agree on the order, and MPI is only ever entered from one thread at a time);
`allreduce_async` returns at once with a handle, which lets gradient buckets travel while
backward still computes. A blocking call made while that thread has nothing queued runs on the
caller's own thread instead: the hand-off to the comm thread and back cost 20-30 us per call on
a 2-core machine, 10-15% of a 1-4 MiB allreduce.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from collectives import algorithms, tuning
from collectives.algorithms import ReduceOp
from collectives.base import CollectivesError, Deferred
from collectives.config import ALGORITHMS
from collectives.waits import wait_all

log = logging.getLogger("collectives")
T = TypeVar("T")

# auto's choice when it was not tuned on the job's ranks (comm.autotune=false, or before tune()):
# crossovers once measured on 2 and 4 ranks of the development VM. MPI_Allreduce has about half
# our latency up to 512 KiB; recursive halving/doubling beat the ring up to 2 MiB.
MPI_MAX_BYTES = 1 << 20
RHD_MAX_BYTES = 4 << 20

# Open MPI 4.1 has no reduction for float16 or bfloat16: those go through the ring.
MPI_DTYPES = {torch.float32, torch.float64, torch.int32, torch.int64}


class MpiCollectives:
    def __init__(
        self, comm: Any, algorithm: str = "auto", node_rank: int | None = None, local_rank: int | None = None, node_position: int | None = None
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise CollectivesError(f"comm.algorithm={algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        self._comm = comm
        # Ranks arrive here seconds apart (imports, a node busier than another): the first to
        # come wait without spinning (collectives.waits) rather than in the blocking Split below.
        self._wait_for_every_rank()
        self.rank: int = comm.Get_rank()
        self.world_size: int = comm.Get_size()
        self.device = torch.device("cpu")  # the engine reduces CPU tensors; the model stays with them
        self.algorithm = algorithm
        # Our ring algorithms run on a copy of the world ordered by switch position, so ring
        # neighbours share a leaf switch; ranks, roots and everything else keep the world's order.
        self._node_rank = node_rank
        self._ring_comm = comm
        if node_position is not None and local_rank is not None:
            self._ring_comm = comm.Split(color=0, key=node_position * self.world_size + local_rank)
        self._node_comm, self._rail_comm = self._split_hierarchy(node_rank, local_rank, node_position)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpi-comm")
        self._order = threading.Lock()  # held while MPI is entered outside the comm thread
        self._queued = 0  # submitted to the comm thread and not finished yet
        self._table: tuning.TuningTable | None = None  # auto's measured choices (tune())
        self.tuned_from = ""  # where that table came from, for the log and the tests
        self._choices: dict[tuple[int, str, torch.dtype], str] = {}

    @classmethod
    def from_world(
        cls, algorithm: str = "auto", node_rank: int | None = None, local_rank: int | None = None, node_position: int | None = None
    ) -> MpiCollectives:
        try:
            from mpi4py import MPI
        except ImportError as err:  # mpi4py present but libmpi missing, or not installed
            raise CollectivesError(f"comm=mpi needs mpi4py and an MPI library: {err}") from None
        if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
            raise CollectivesError("the MPI library gives no MPI_THREAD_SERIALIZED; the comm thread needs it")
        return cls(MPI.COMM_WORLD, algorithm, node_rank, local_rank, node_position)

    def _split_hierarchy(self, node_rank: int | None, local_rank: int | None, node_position: int | None) -> tuple[Any, Any]:
        """One communicator per node and one per rail (same local_rank, so the same NIC rail, on
        every node), the rail's ring in switch order when known."""
        if node_rank is None or local_rank is None:
            return None, None
        node_comm = self._comm.Split(color=node_rank, key=local_rank)
        rail_comm = self._comm.Split(color=local_rank, key=node_rank if node_position is None else node_position)
        sizes = self._comm.allgather(node_comm.Get_size())
        if len(set(sizes)) != 1:  # a rail needs one rank per node on every node
            log.warning("nodes have unequal rank counts %s: hierarchical allreduce falls back to auto's choice", sorted(set(sizes)))
            node_comm.Free()  # unused from here on: not freeing them leaked two communicators per engine
            rail_comm.Free()
            return None, None
        return node_comm, rail_comm

    # --- auto, by measurement ------------------------------------------------------------------

    @property
    def table(self) -> tuning.TuningTable | None:
        return self._table

    @table.setter
    def table(self, table: tuning.TuningTable | None) -> None:
        self._table = table
        self._choices.clear()  # made from the table before

    def candidates(self) -> list[str]:
        """The algorithms auto chooses among on this job's layout."""
        return ["mpi", "rhd", "ring", *(["hierarchical"] if self._nodes() > 1 else [])]

    def tune(self, cache_dir: str | None, pinned: Path | None = None) -> tuning.TuningTable | None:
        """Collective: time every candidate on these ranks, so that auto runs the fastest at every
        size. A table already pinned for this job (`pinned`, read first: a restart must choose
        as the first start did), or cached in `cache_dir` for this host type, world size and node
        shape, is used instead; a measured one is written to both."""
        if self.world_size == 1:
            return None
        candidates = self.candidates()
        node_of_rank = self._comm.allgather(self._node_rank)
        node_sizes = tuple(Counter(node_of_rank).values()) if None not in node_of_rank else ()
        key = tuning.tuning_key(tuning.host_type(), self.world_size, node_sizes, mpi_library(), candidates)
        cached = tuning.cache_file(cache_dir, key) if cache_dir else None
        found, where = None, ""
        if self.rank == 0:
            for source, path in (("pinned to this job", pinned), ("cached", cached)):
                found = tuning.read_table(path, key) if path is not None else None
                if found is not None:
                    where = f"{source} in {path}"
                    break
        text, where = self._comm.bcast((found.to_json() if found else None, where), root=0)  # one table for all ranks
        if text is not None:
            self.table = tuning.TuningTable.from_json(text, key)
        else:
            self.table = self.measure(key)
            where = f"measured in {self.table.tuned_in_s:.2f} s"
            if self.rank == 0 and cached is not None and tuning.write_table(cached, self.table):
                where += f", cached in {cached}"
        if self.rank == 0 and pinned is not None and not where.startswith("pinned"):
            tuning.write_table(pinned, self.table)
        self.tuned_from = where
        if self.rank == 0:
            log.info("allreduce auto on %d ranks (%s): %s", self.world_size, where, tuning.describe(self.table, tuning.TUNED_SIZES, candidates))
        return self.table

    def measure(self, key: str, sizes: tuple[int, ...] = tuning.TUNED_SIZES, rounds: int = 2, warmup: int = 1) -> tuning.TuningTable:
        """Collective: a tuning table measured now on these ranks, every candidate at every size
        (tuning.measure_table), neither cached nor adopted."""
        return tuning.measure_table(self._comm, self._run_now, self.candidates(), key, sizes, rounds=rounds, warmup=warmup)

    def _run_now(self, buffer: torch.Tensor, algorithm: str) -> None:
        self._call(self._allreduce_now, buffer, "sum", algorithm)

    def _nodes(self) -> int:
        return self._rail_comm.Get_size() if self._rail_comm is not None else 0

    # --- what callers use ---------------------------------------------------------------------

    def allreduce_(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> None:
        self._call(self._allreduce_now, _flat_view(buffer), op, self.algorithm)

    def allreduce_async(self, buffer: torch.Tensor, op: ReduceOp = "sum", algorithm: str | None = None) -> Deferred:
        flat = _flat_view(buffer)
        return Deferred(self._submit(self._allreduce_now, flat, op, algorithm or self.algorithm).result)

    def broadcast_(self, buffer: torch.Tensor, root: int = 0) -> None:
        self._call(algorithms.broadcast, self._comm, _flat_view(buffer), root)

    def allgather(self, mine: torch.Tensor) -> torch.Tensor:
        return self._call(algorithms.allgather, self._comm, _flat_view(mine))

    def allgather_async(self, mine: torch.Tensor) -> Deferred:
        return Deferred(self._submit(algorithms.allgather, self._comm, _flat_view(mine)).result)

    def reduce_scatter(self, buffer: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        return self._call(algorithms.reduce_scatter, self._comm, _flat_view(buffer), op)

    def reduce_scatter_async(self, buffer: torch.Tensor) -> Deferred:
        """The ring's reduce-scatter (half an allreduce's traffic); the chunk is a view of `buffer`."""
        return Deferred(self._submit(algorithms.reduce_scatter, self._comm, _flat_view(buffer), "sum").result)

    def barrier(self) -> None:
        self._call(self._wait_for_every_rank)

    def _wait_for_every_rank(self) -> None:
        wait_all([self._comm.Ibarrier()])

    # --- ordering: every collective in the order callers issued it ----------------------------

    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._order:
            self._queued += 1
            return self._worker.submit(self._counted, fn, *args)

    def _counted(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        finally:
            with self._order:
                self._queued -= 1

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Blocking: on this thread when the comm thread has nothing queued (the lock keeps a
        submission from another thread behind it), else behind what is queued."""
        with self._order:
            if self._queued == 0:
                return fn(*args)
        return self._submit(fn, *args).result()

    def abort(self, code: int = 1) -> None:
        """End every rank of the job now: one rank's failure must not leave the others waiting."""
        self._comm.Abort(code)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        for comm in (self._node_comm, self._rail_comm, None if self._ring_comm is self._comm else self._ring_comm):
            if comm is not None:
                comm.Free()
        self._node_comm = self._rail_comm = None
        self._ring_comm = self._comm

    # --- on the comm thread -------------------------------------------------------------------

    def choose(self, nbytes: int, algorithm: str, dtype: torch.dtype = torch.float32) -> str:
        known = self._choices.get((nbytes, algorithm, dtype))
        if known is None:  # the table's interpolation costs 10-20 us: 5-10% of a 1 MiB allreduce
            known = self._choose(nbytes, algorithm, dtype)
            if len(self._choices) >= 4096:  # sizes come from a few buckets; never grow without end
                self._choices.clear()
            self._choices[nbytes, algorithm, dtype] = known
        return known

    def _choose(self, nbytes: int, algorithm: str, dtype: torch.dtype) -> str:
        nodes = self._nodes()
        if self.table is not None and algorithm in ("auto", "hierarchical") and not (algorithm == "hierarchical" and nodes):
            eligible = [name for name in self.candidates() if name != "mpi" or dtype in MPI_DTYPES]
            chosen = self.table.fastest(nbytes, eligible)
            if chosen is not None:
                return chosen
        return choose_algorithm(nbytes, algorithm, dtype, nodes)

    def _allreduce_now(self, buf: torch.Tensor, op: ReduceOp, algorithm: str) -> None:
        if self.world_size == 1:
            return
        chosen = self.choose(buf.numel() * buf.element_size(), algorithm, buf.dtype)
        if chosen == "mpi" and buf.dtype in MPI_DTYPES:
            from mpi4py import MPI

            if buf.numel():
                mpi_op = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op]
                if buf.numel() * buf.element_size() <= POLLED_MPI_MAX_BYTES:
                    wait_all([self._comm.Iallreduce(MPI.IN_PLACE, buf.numpy(), op=mpi_op)])
                else:
                    self._comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=mpi_op)
            algorithms.finish_average(buf, op, self.world_size)
        elif chosen == "hierarchical":
            algorithms.hierarchical_allreduce(self._node_comm, self._rail_comm, buf, op)
        elif chosen == "rhd":
            algorithms.rhd_allreduce(self._ring_comm, buf, op)
        else:  # ring, and mpi for dtypes MPI has no reduction for (bfloat16)
            algorithms.ring_allreduce(self._ring_comm, buf, op)


# MPI_Allreduce at or below this size runs as MPI_Iallreduce, waited on without spinning
# (collectives.waits): the stop vote, metrics and a step's scalars, the collectives where ranks
# meet at a step boundary and wait for a late peer. Above it the blocking call stays: Open MPI's
# non-blocking allreduce (libnbc) measured 2-3x slower at 16-256 KiB on 2 ranks here.
POLLED_MPI_MAX_BYTES = 4096


def choose_algorithm(nbytes: int, algorithm: str = "auto", dtype: torch.dtype = torch.float32, nodes: int = 0) -> str:
    """The algorithm an allreduce of `nbytes` per rank runs. `nodes`: how many nodes the
    hierarchy spans, 0 when there is none (no node layout, or nodes with unequal rank counts)."""
    if algorithm == "hierarchical" and nodes == 0:
        algorithm = "auto"
    if algorithm == "auto":
        if nbytes < MPI_MAX_BYTES and dtype in MPI_DTYPES:
            return "mpi"
        if nbytes < RHD_MAX_BYTES:
            return "rhd"
        return "hierarchical" if nodes > 1 else "ring"
    return algorithm


def mpi_library() -> str:
    """The MPI library's name and version ('Open MPI v4.1.4'), as MPI itself reports it."""
    from mpi4py import MPI

    return MPI.Get_library_version().split(",")[0].strip()


def _flat_view(buffer: torch.Tensor) -> torch.Tensor:
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise CollectivesError("the mpi backend works on contiguous CPU tensors")
    return buffer.view(-1)
