"""The run handle's core: the guarantees of the built-in loop for a loop the user owns.

What a script registers (models, optimizers, schedulers, the grad scaler, a data position, any
object with state_dict/load_state_dict, plain values) is restored from the newest committed
checkpoint at start; at every step boundary one small allreduce carries the stop vote, the save
handshake, the timed-save vote and the step's metrics, so every rank decides alike whether to
save and whether to stop. The state is kept, saved and restored as the built-in loop's is
(trainers.checkpoint.registry: one layout, one restore path). hpc.run builds this from the
launcher's environment.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from collectives.base import Collectives
from trainers.boundary import PendingVote, StepBoundary, StepVote
from trainers.checkpoint.recovery import restore_newest
from trainers.checkpoint.registry import SCRIPT_TASK, Registry, own_checkpoint, shared_checkpoint
from trainers.checkpoint.saving import SaveCoordinator
from trainers.preemption import StopFlag
from trainers.reporting import metricnames
from trainers.reporting.memory import peaks_over_ranks
from trainers.reporting.reporter import StepReporter
from trainers.task import TaskError

log = logging.getLogger("trainers")


# Counts a script may pass to end_step() (this rank's samples or tokens in the step): steps.jsonl
# then holds their rate over all ranks, under the built-in loop's names.
COUNTED = {"samples": "samples_per_s", "tokens": "tokens_per_s"}


@dataclass
class Handle:
    """One per rank; see hpc.run for the user's side."""

    comm: Collectives
    registry: Registry
    boundary: StepBoundary  # the stop vote, the save handshake, saving: as in the built-in loop
    reporter: StepReporter = field(default_factory=lambda: StepReporter(None))
    config_text: str = ""
    step: int = 0
    resumed_from: int | None = None
    stopped_by: str | None = None
    finished: bool = False
    owned_comm: bool = False  # the handle started the collectives it votes through (MPI): it closes them
    last: dict[str, float] = field(default_factory=dict)  # the newest step's metrics (means over ranks)
    logged: dict[str, float] = field(default_factory=dict)  # the newest value of each metric log() wrote
    validation: dict[str, float] = field(default_factory=dict)  # the newest val_* passed to end_step()
    _step_began: float = field(default_factory=time.perf_counter)
    _pending: PendingVote | None = None

    @property
    def stop(self) -> StopFlag:
        return self.boundary.stop

    @property
    def coordinator(self) -> SaveCoordinator | None:
        return self.boundary.coordinator

    def agree_on_registry(self) -> None:
        """Every rank registered the same names (a mismatch would pair the wrong files on resume)."""
        everyone = metricnames.exchange(self.comm, self.registry.names())
        first = everyone[0] or ()
        for rank, other in enumerate(everyone):
            extra = [n for n in other or () if n not in first]
            missing = [n for n in first if n not in (other or ())]
            if extra or missing:
                who, whom, what = (rank, 0, extra[0]) if extra else (0, rank, missing[0])
                kind, name = what.split(":", 1)
                raise TaskError(
                    f"the ranks register different run state: rank {who} registers {kind} {name!r}, which rank {whom} does not; "
                    "every rank must register the same"
                )

    def restore(self, checkpoint_dir: Path, resume: bool = True) -> int | None:
        """Load the newest committed checkpoint into the registered state; its step, or None."""
        restored = restore_newest(self.coordinator, self.comm, self.registry, SCRIPT_TASK, resume)
        if restored is None:
            log.info("starting fresh: no committed checkpoint in %s", checkpoint_dir)
            return None
        step, own_file = restored
        self.step = self.resumed_from = step
        log.info("resumed from checkpoint step %d%s", step, "" if own_file else " (world size changed: fresh RNG streams)")
        return step

    def end_step(self, metrics: dict[str, Any]) -> bool:
        """Count a step; share its metrics, the votes and the save handshake in one allreduce;
        save when due; True when every rank must stop now (the state is saved)."""
        if self.finished or self.stopped_by:
            raise TaskError("end_step() after the run was stopped or finished; leave the loop when end_step() returns True")
        names = tuple(sorted(metrics))
        for name in names:
            value = metrics[name]
            if isinstance(value, torch.Tensor) and value.numel() != 1 or not isinstance(value, torch.Tensor | int | float):
                raise TaskError(f"metric {name!r} is {describe(value)}; end_step() takes numbers or one-element tensors")
        self.step += 1
        now = time.perf_counter()
        step_s, self._step_began = now - self._step_began, now
        boundary = self.boundary
        boundary.stepped(self.step, self.resumed_from)
        earlier = self.settle()  # the previous step's vote, read now: its allreduce ran beside this step
        self._pending = boundary.launch(self.step, names, [metrics[n] for n in names], step_s)
        stop = earlier is not None and earlier.stop_votes > 0
        due = boundary.save_due(self.step, earlier)
        if stop or due:  # a save's own collectives come after this step's vote, on every rank alike
            latest = self.settle()
            stop = stop or (latest is not None and latest.stop_votes > 0)
        if stop:
            self.stopped_by = self.boundary.stop_name()
            self.save(synchronous=True)
            return True
        if due:
            self.save(synchronous=False)
        return False

    def settle(self) -> StepVote | None:
        """Read the vote in flight (None: none): its metrics reported, the save handshake advanced."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        vote = self.boundary.settle(pending)
        self.last = {name: value / self.comm.world_size for name, value in zip(pending.names, vote.values, strict=True)}
        self.validation.update({name: value for name, value in self.last.items() if name.startswith("val_")})
        record = {"step": pending.step, **self.last, "step_ms": 1000 * pending.step_s}
        for count, rate in COUNTED.items():  # a count each rank reports: the sum over ranks per second
            if count in self.last and pending.step_s > 0:
                record[rate] = self.last[count] * self.comm.world_size / pending.step_s
        self.reporter.report(record)
        return vote

    def log(self, metrics: dict[str, Any], step: int | None) -> None:
        """A moment's record for the sinks (metrics.jsonl keeps it; rank 0's values; no communication)."""
        record: dict[str, Any] = {"step": self.step if step is None else step}
        for name, value in metrics.items():
            number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if not isinstance(number, int | float) or isinstance(number, bool):
                raise TaskError(f"metric {name!r} is {describe(value)}; log() takes numbers or one-element tensors")
            record[name] = float(number)
        self.logged.update({k: v for k, v in record.items() if k != "step"})
        self.reporter.moment(record)

    def save(self, synchronous: bool = True) -> None:
        """A checkpoint of the current step (all ranks call it at the same point)."""
        if self.coordinator is None:
            return
        self.settle()  # the vote in flight first: collectives in the same order on every rank
        registry = self.registry
        self.boundary.save(
            self.step,
            lambda: shared_checkpoint(registry, self.step, self.comm.world_size, self.config_text, {"task": SCRIPT_TASK}),
            lambda: own_checkpoint(registry),
            synchronous,
        )

    def finish(self) -> None:
        """The final save (when steps were trained since the last one), and everything closed."""
        if self.finished:
            return
        self.finished = True
        watchdog = self.boundary.watchdog
        if watchdog is not None:  # the other ranks may still be stepping: a stall names this rank
            watchdog.leave("left the loop (the run handle's finish())")
        ended_as = "FAILED"  # for the trackers; an exception leaves it so
        try:
            self.settle()  # the last step's vote: its metrics reported (a stop it carries comes too late to matter)
            if self.stopped_by is None and self.step > (self.resumed_from or 0):
                self.save(synchronous=True)
            elif self.coordinator is not None:
                self.coordinator.finish_pending()
            self.reporter.moment({"step": self.step, "peak_memory_mib": peaks_over_ranks(self.comm)})
            ended_as = "STOPPED" if self.stopped_by is not None else "FINISHED"
        finally:
            self.close(ended_as)

    def close(self, ended_as: str = "FAILED") -> None:
        """`ended_as`: how this start ends for the metrics sinks (FINISHED, STOPPED, FAILED)."""
        boundary = self.boundary
        boundary.close()
        quiesce = getattr(self.comm, "quiesce", None)  # torch.distributed's threads let go of the votes (collectives/torchdist.py)
        if quiesce is not None:
            quiesce()
        if boundary.watchdog is not None:  # the handle's own (hpc.run started it)
            boundary.watchdog.close()
            boundary.watchdog = None
        self.reporter.close(ended_as)


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
