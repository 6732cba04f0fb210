"""Each rank's peak memory: on a GPU the caching allocator's peak (`max_memory_allocated`), on a
CPU the process's peak resident set (`getrusage`: what the kernel counted, the data loader's
threads included, its worker processes not)."""

from __future__ import annotations

import resource
import sys

import torch

from collectives.base import Collectives


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def peaks_over_ranks(comm: Collectives) -> list[float]:
    """Every rank's peak, in rank order (one small allgather; every rank calls it)."""
    mine = torch.tensor([peak_memory_mib(comm.device)], dtype=torch.float64)
    return [round(value, 1) for value in comm.allgather(mine).tolist()]
