"""Collective algorithms on mpi4py point-to-point messages, over flat CPU torch tensors.

Bytes travel as zero-copy uint8 views of the tensors, so every dtype torch has (bfloat16 too)
moves the same way; reductions run as torch kernels, which are fast for half types where
numpy's are not. Every function is collective: all ranks of `comm` call it, in the same order,
with buffers of the same element count and dtype.

Chunk i of an n-element buffer split over p ranks is [n*i//p, n*(i+1)//p): any n works,
including 0, 1 and counts not divisible by p (some chunks are then empty).
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch

from collectives.waits import wait_all

ReduceOp = Literal["sum", "avg", "max", "min"]
Comm = Any  # an mpi4py communicator (Intracomm); typed loosely so this module imports without MPI


_scratch_cache = threading.local()


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable receive buffer: fresh large allocations cost page faults on every call."""
    cache: dict[torch.dtype, torch.Tensor] = _scratch_cache.__dict__.setdefault("buffers", {})
    buffer = cache.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = cache[dtype] = torch.empty(max(numel, 1024), dtype=dtype)
    return buffer[:numel]


def _wire(t: torch.Tensor) -> Any:
    """A writable numpy uint8 view sharing memory with the contiguous tensor t."""
    return t.view(torch.uint8).numpy() if t.numel() else bytearray()


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: ReduceOp) -> None:
    if op in ("sum", "avg"):
        dst.add_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    else:
        raise ValueError(f"unknown reduction {op!r}")


def finish_average(buf: torch.Tensor, op: ReduceOp, world_size: int) -> None:
    if op == "avg" and world_size > 1:
        if not buf.is_floating_point():
            raise TypeError(f"op='avg' needs a floating-point buffer, not {buf.dtype}")
        buf.div_(world_size)


def chunks_of(buf: torch.Tensor, parts: int) -> list[torch.Tensor]:
    n = buf.numel()
    return [buf[n * i // parts : n * (i + 1) // parts] for i in range(parts)]


# Non-blocking messages, waited on without spinning (collectives.waits): Sendrecv, Send and Recv
# would hold a core while a peer is late.
def _sendrecv(comm: Comm, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int) -> None:
    wait_all([comm.Irecv(_wire(recv), source=source), comm.Isend(_wire(send), dest=dest)])


def _send(comm: Comm, send: torch.Tensor, dest: int) -> None:
    wait_all([comm.Isend(_wire(send), dest=dest)])


def _recv(comm: Comm, recv: torch.Tensor, source: int) -> None:
    wait_all([comm.Irecv(_wire(recv), source=source)])


# --- ring: bandwidth-optimal, 2(p-1) steps each moving n/p elements ---------------------------


def ring_reduce_scatter_chunks(comm: Comm, chunks: list[torch.Tensor], op: ReduceOp) -> None:
    """After p-1 steps, rank r holds the reduction of chunk r (other chunks hold partials)."""
    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    receive = scratch(max(c.numel() for c in chunks), chunks[0].dtype)
    for step in range(p - 1):
        send, recv = chunks[(r - step - 1) % p], chunks[(r - step - 2) % p]
        incoming = receive[: recv.numel()]
        _sendrecv(comm, send, right, incoming, left)
        reduce_into(recv, incoming, op)


def ring_allgather_chunks(comm: Comm, chunks: list[torch.Tensor]) -> None:
    """Rank r starts owning chunk r; after p-1 steps every rank holds every chunk."""
    p, r = comm.Get_size(), comm.Get_rank()
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        _sendrecv(comm, chunks[(r - step) % p], right, chunks[(r - step - 1) % p], left)


def ring_allreduce(comm: Comm, buf: torch.Tensor, op: ReduceOp = "sum") -> None:
    chunks = chunks_of(buf, comm.Get_size())
    ring_reduce_scatter_chunks(comm, chunks, op)
    ring_allgather_chunks(comm, chunks)
    finish_average(buf, op, comm.Get_size())


# --- recursive halving / doubling (Rabenseifner): 2 log p steps, latency-friendly -------------


def _fold_in(comm: Comm, buf: torch.Tensor, op: ReduceOp, pof2: int) -> int | None:
    """Fold a non-power-of-two world into pof2 ranks; returns this rank's new rank or None."""
    r, rem = comm.Get_rank(), comm.Get_size() - pof2
    if r < 2 * rem:
        if r % 2 == 0:
            _send(comm, buf, dest=r + 1)
            return None
        incoming = scratch(buf.numel(), buf.dtype)
        _recv(comm, incoming, source=r - 1)
        reduce_into(buf, incoming, op)
        return r // 2
    return r - rem


def _real_rank(new_rank: int, rem: int) -> int:
    return new_rank * 2 + 1 if new_rank < rem else new_rank + rem


def rhd_allreduce(comm: Comm, buf: torch.Tensor, op: ReduceOp = "sum") -> None:
    p = comm.Get_size()
    if p == 1:
        return
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    new_rank = _fold_in(comm, buf, op, pof2)
    if new_rank is not None:
        n = buf.numel()
        bounds = [n * i // pof2 for i in range(pof2 + 1)]  # block i is buf[bounds[i]:bounds[i+1]]

        def blocks(lo: int, hi: int) -> torch.Tensor:
            return buf[bounds[lo] : bounds[hi]]

        receive = scratch(n - n // 2, buf.dtype)  # the first halving keeps the larger half at most
        lo, hi = 0, pof2  # the blocks this rank is responsible for
        mask = pof2 >> 1
        while mask:  # recursive halving reduce-scatter: keep half, send the other half
            partner = _real_rank(new_rank ^ mask, rem)
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if new_rank & mask == 0 else ((mid, hi), (lo, mid))
            kept = blocks(*keep)
            incoming = receive[: kept.numel()]
            _sendrecv(comm, blocks(*give), partner, incoming, partner)
            reduce_into(kept, incoming, op)
            lo, hi = keep
            mask >>= 1
        mask = 1
        while mask < pof2:  # recursive doubling allgather: swap halves, double the range
            partner = _real_rank(new_rank ^ mask, rem)
            size = hi - lo
            other = (hi, hi + size) if new_rank & mask == 0 else (lo - size, lo)
            _sendrecv(comm, blocks(lo, hi), partner, blocks(*other), partner)
            lo, hi = min(lo, other[0]), max(hi, other[1])
            mask <<= 1
    r = comm.Get_rank()
    if r < 2 * rem:  # unfold: odd ranks hand the result back to the even rank that sat out
        if r % 2 == 1:
            _send(comm, buf, dest=r - 1)
        else:
            _recv(comm, buf, source=r + 1)
    finish_average(buf, op, p)


# --- other collectives ------------------------------------------------------------------------


def reduce_scatter(comm: Comm, buf: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
    """Returns a view of buf holding this rank's reduced chunk (chunk r of p)."""
    chunks = chunks_of(buf, comm.Get_size())
    ring_reduce_scatter_chunks(comm, chunks, op)
    mine = chunks[comm.Get_rank()]
    finish_average(mine, op, comm.Get_size())
    return mine


def allgather(comm: Comm, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's equally sized `mine`, concatenated in rank order."""
    p, r = comm.Get_size(), comm.Get_rank()
    out = torch.empty(p * mine.numel(), dtype=mine.dtype)
    chunks = list(out.view(p, -1)) if mine.numel() else [out[:0]] * p
    chunks[r].copy_(mine.reshape(-1))
    ring_allgather_chunks(comm, chunks)
    return out


BROADCAST_TREE_MAX_BYTES = 256 * 1024


def broadcast(comm: Comm, buf: torch.Tensor, root: int = 0) -> None:
    """Binomial tree for small buffers; scatter + ring allgather (van de Geijn) for large ones."""
    p = comm.Get_size()
    if p == 1 or buf.numel() == 0:
        return
    rel = (comm.Get_rank() - root) % p
    if buf.numel() * buf.element_size() <= BROADCAST_TREE_MAX_BYTES:
        mask = 1
        while mask < p:  # receive once from the parent...
            if rel & mask:
                _recv(comm, buf, source=(rel - mask + root) % p)
                break
            mask <<= 1
        mask >>= 1
        while mask:  # ...then forward to the children below this rank's lowest set bit
            if rel + mask < p:
                _send(comm, buf, dest=(rel + mask + root) % p)
            mask >>= 1
        return
    # Large: chunks in root-relative order; the root sends each rank its chunk, then a ring
    # allgather in relative numbering completes everybody's copy (about 2x the data of the tree).
    chunks = chunks_of(buf, p)  # chunk i goes to root-relative rank i
    if rel == 0:
        for i in range(1, p):
            _send(comm, chunks[i], dest=(i + root) % p)
    else:
        _recv(comm, chunks[rel], source=root)
    _ring_allgather_relative(comm, chunks, rel, root)


def _ring_allgather_relative(comm: Comm, chunks: list[torch.Tensor], rel: int, root: int) -> None:
    p = comm.Get_size()
    right, left = (rel + 1 + root) % p, (rel - 1 + root) % p
    for step in range(p - 1):
        _sendrecv(comm, chunks[(rel - step) % p], right, chunks[(rel - step - 1) % p], left)


# --- hierarchical: inside the node, across the rail, inside the node --------------------------


def hierarchical_allreduce(node_comm: Comm, rail_comm: Comm, buf: torch.Tensor, op: ReduceOp = "sum", inter: str = "ring") -> None:
    """Reduce-scatter among the node's ranks, allreduce each slice across nodes on its rail
    (ranks with the same local_rank), allgather among the node's ranks."""
    chunks = chunks_of(buf, node_comm.Get_size())
    ring_reduce_scatter_chunks(node_comm, chunks, op)
    mine = chunks[node_comm.Get_rank()]
    inner_op: ReduceOp = "sum" if op == "avg" else op
    # Slice sizes depend only on n and the node size, so a rail's ranks agree on them.
    (rhd_allreduce if inter == "rhd" else ring_allreduce)(rail_comm, mine, inner_op)
    ring_allgather_chunks(node_comm, chunks)
    finish_average(buf, op, node_comm.Get_size() * rail_comm.Get_size())
