"""The step boundary, once for both loops (the built-in Loop and the run handle of a user's loop).

After every optimizer step the ranks add up one small buffer: the stop vote (a signal on any rank
stops all of them at the same step), the save handshake (an asynchronous checkpoint commits once
every rank has written its part), the timed-save vote, the storage-fault vote (a write the file system refused on any rank ends
every rank at that step: trainers.faults), the fingerprint of the metric names
(trainers.reporting.metricnames) and the step's own figures. Every rank then reads the same sums and decides
alike: stop, save, or go on. The launch and the read are separate calls, so a loop may let the
allreduce run beside its next step (the run handle does) or read it at once (the built-in Loop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from collectives.base import Collectives, Deferred, InFlight
from trainers.checkpoint.saving import SaveCoordinator
from trainers.context import Milestones
from trainers.faults import FAULTS, FaultLatch, StorageFailure, agreed_fault
from trainers.preemption import StopFlag
from trainers.reporting import metricnames
from trainers.task import TaskError
from trainers.watchdog import Watchdog

CPU = torch.device("cpu")
HEAD = 8  # stop votes, ranks written, time votes, storage faults and the names' four fingerprint numbers


@dataclass
class StepVote:
    """A step boundary's sums over the ranks."""

    stop_votes: float  # ranks that received a stop signal
    ranks_written: float  # ranks with no checkpoint write in flight
    time_votes: float  # ranks whose clock says a timed save is due
    fault_votes: float  # ranks whose file system refused a write (trainers.faults)
    names: tuple[float, ...]  # the metric names' fingerprints, summed
    values: list[float]  # the loop's own figures, summed


@dataclass
class PendingVote:
    """A step's vote in flight, until `StepBoundary.settle` reads it."""

    step: int
    names: tuple[str, ...]  # the metric names this rank reported (their fingerprint rides along)
    step_s: float
    buffer: torch.Tensor
    done: InFlight

    @classmethod
    def launch(cls, comm: Collectives, step: int, names: tuple[str, ...], step_s: float, head: list[float], values: list[Any], overlap: bool) -> PendingVote:
        """Tensors stay on their device: the one host sync is the read. overlap=False: reduced
        here, on this thread (no hand-over to the engine's background thread). A world of one
        reduces nothing."""
        buffer = packed(head, values)
        if comm.world_size == 1:
            return cls(step, names, step_s, buffer, Deferred.of())
        if not overlap:
            comm.allreduce_(buffer, op="sum")
            return cls(step, names, step_s, buffer, Deferred.of())
        return cls(step, names, step_s, buffer, comm.allreduce_async(buffer, op="sum"))

    def read(self) -> StepVote:
        self.done.wait()
        values = self.buffer.tolist()
        return StepVote(values[0], values[1], values[2], values[3], tuple(values[4:HEAD]), values[HEAD:])


def packed(head: list[float], values: list[Any]) -> torch.Tensor:
    """`head` and `values` (numbers and one-element tensors) as one float64 tensor, without reading
    any tensor on the host: on the device where a value lives, else on the CPU. Each run of
    numbers travels as one tensor and each run of tensors is stacked: a few operations per step,
    whatever the number of values."""
    target = next((v.device for v in values if isinstance(v, torch.Tensor) and v.device.type != "cpu"), CPU)
    parts: list[torch.Tensor] = []
    numbers: list[float] = [float(v) for v in head]
    tensors: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            if numbers:
                parts.append(torch.tensor(numbers, dtype=torch.float64, device=target))
                numbers = []
            value = value.detach() if value.requires_grad else value
            tensors.append(value.reshape(()) if value.ndim else value)
        else:
            if tensors:
                parts.append(stacked(tensors, target))
                tensors = []
            numbers.append(float(value))
    if numbers:
        parts.append(torch.tensor(numbers, dtype=torch.float64, device=target))
    if tensors:
        parts.append(stacked(tensors, target))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def stacked(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-dim tensors as one float64 vector on `device`, each converted first (stack's own type
    promotion costs twice as much as the conversions, and an int64 beside a float32 would
    pass through float32)."""
    if device.type != "cpu":
        tensors = [t.to(device) for t in tensors]  # a CPU value beside device ones: copied over
    return torch.stack([t if t.dtype == torch.float64 else t.to(torch.float64) for t in tensors])


@dataclass
class StepBoundary:
    """What every step's end agrees on, and the saves it decides."""

    comm: Collectives
    stop: StopFlag
    coordinator: SaveCoordinator | None
    watchdog: Watchdog | None = None
    milestones: Milestones = field(default_factory=Milestones)
    faults: FaultLatch = field(default_factory=lambda: FAULTS)  # this process's (a test's threads each have their own)

    def stepped(self, step: int, resumed_from: int | None) -> None:
        """A step finished on this rank: the watchdog and the run's timeline learn of it."""
        self.milestones.stepped(step, resumed_from)
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def launch(self, step: int, names: tuple[str, ...], values: list[Any], step_s: float = 0.0, overlap: bool = True) -> PendingVote:
        coordinator = self.coordinator
        head = [
            float(self.stop.raised),
            coordinator.written_flag() if coordinator else 1.0,
            coordinator.time_vote() if coordinator else 0.0,
            float(self.faults.noted),
            *metricnames.fingerprint(names),
        ]
        return PendingVote.launch(self.comm, step, names, step_s, head, values, overlap)

    def settle(self, pending: PendingVote, expected: tuple[str, ...] | None = None) -> StepVote:
        """The sums, once every rank reported the same metric names (`expected`: the names agreed
        earlier, when the values travel in their order); the save handshake advanced."""
        vote = pending.read()
        agreed = pending.names if expected is None else expected
        if not metricnames.fingerprints_agree(vote.names, agreed, self.comm.world_size):
            now = metricnames.agree(self.comm, pending.names, f"step {pending.step}")  # raises on every rank, naming the key and rank
            raise TaskError(metricnames.changed_line(pending.step, agreed, now))  # all ranks alike, but not as agreed
        if vote.fault_votes > 0:
            raise self.storage_failure(pending.step)
        if self.coordinator is not None:
            self.coordinator.on_step_boundary(vote.ranks_written)
        return vote

    def storage_failure(self, step: int) -> StorageFailure:
        """A rank's file system refused a write: what every rank raises at this step, alike. A
        save in flight is dropped (its staging removed): only committed checkpoints count."""
        if self.coordinator is not None:
            self.coordinator.drop_pending()
        failure = agreed_fault(self.comm, self.faults.first, step)
        assert failure is not None, "a fault vote from a rank that noted no fault"
        return failure

    def stop_name(self) -> str:
        """What an agreed stop is named by on this rank: its own signal, or another rank's."""
        return self.stop.signal_name or "a signal on another rank"

    def stopped_by(self, vote: StepVote) -> str | None:
        """The stop every rank agreed on (the signal's name), or None to go on."""
        return self.stop_name() if vote.stop_votes > 0 else None

    def save_due(self, step: int, vote: StepVote | None) -> bool:
        return self.coordinator is not None and self.coordinator.due(step, vote.time_votes if vote else 0.0)

    def stop_agreed(self) -> str | None:
        """Before the first step: whether any rank was asked to stop during start-up or resume."""
        votes = torch.tensor([float(self.stop.raised)], dtype=torch.float64)
        self.comm.allreduce_(votes, op="max")
        return self.stop_name() if votes[0] > 0 else None

    def save(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: Callable[[], dict[str, Any]],
        synchronous: bool,
        later: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        """A checkpoint of `step` (every rank calls it at the same point). The stop flag's phase
        says what the main thread does: an asynchronous save goes on in the background once its
        snapshot is taken, and training with it."""
        if self.coordinator is None:
            return
        before, self.stop.phase = self.stop.phase, "the final save" if synchronous else "an asynchronous save"
        try:
            self.coordinator.save(step, shared, own(), synchronous, later=later)
        finally:
            self.stop.phase = before

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.checkpointer.wait_pruned()
