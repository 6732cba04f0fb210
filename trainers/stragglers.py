"""Which rank holds the others back: busy time per step compared across ranks every few steps."""

from __future__ import annotations

import torch

from collectives.base import Collectives
from trainers.reporting.reporter import Straggler, find_straggler


class StragglerWatch:
    """Every `every` steps, all ranks share their mean busy time per step since the last check
    (one allgather): data wait, forward+backward and optimizer, without the gradient wait. The
    slowest is reported when above `ratio` x the median. The hosts are gathered once, at the
    first check. With DDP (gloo, nccl) the last gradient bucket's wait falls inside backward, so
    there a straggler shows less clearly."""

    def __init__(self, comm: Collectives, host: str, every: int, ratio: float) -> None:
        self._comm, self._host, self._every, self._ratio = comm, host, every, ratio
        self._hosts: list[str] | None = None
        self._seconds, self._steps = 0.0, 0

    def step(self, step: int, seconds: float) -> Straggler | None:
        self._seconds, self._steps = self._seconds + seconds, self._steps + 1
        if self._every <= 0 or self._comm.world_size < 2 or step % self._every:
            return None  # the same decision on every rank: the step counts agree
        if self._hosts is None:
            encoded = torch.zeros(64, dtype=torch.float64)  # a dtype every backend reduces and gathers
            name = self._host.encode()[:64]
            encoded[: len(name)] = torch.tensor(list(name), dtype=torch.float64)
            gathered = self._comm.allgather(encoded).reshape(self._comm.world_size, 64)
            self._hosts = [bytes(int(v) for v in row.tolist()).rstrip(b"\0").decode(errors="replace") for row in gathered]
        mean_ms = torch.tensor([1000 * self._seconds / self._steps], dtype=torch.float64)
        self._seconds, self._steps = 0.0, 0
        return find_straggler(self._comm.allgather(mean_ms).tolist(), self._hosts, self._ratio)
