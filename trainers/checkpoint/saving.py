"""When to checkpoint, and the cross-rank handshake that makes an async save visible."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from collectives.base import Collectives
from trainers.checkpoint.checkpointer import Checkpointer, CheckpointError
from trainers.checkpoint.memory import MemoryCopies
from trainers.checkpoint.restart import share_own_copies
from trainers.checkpoint.storage import StoreError, run_store
from trainers.config import CheckpointConfig
from trainers.faults import FAULTS, FaultLatch, agreed_fault, storage_error

log = logging.getLogger("trainers.checkpoint.checkpointer")


class SaveCoordinator:
    """Periodic async saves; a save commits once every rank reports it written (the flag rides
    on the per-step allreduce); a final or on-signal save is synchronous."""

    def __init__(self, checkpointer: Checkpointer, comm: Collectives, cfg: CheckpointConfig) -> None:
        self.checkpointer, self.comm, self.cfg = checkpointer, comm, cfg
        self._last_save_time = time.monotonic()
        self.last_step: int | None = None  # the step of the newest save begun (pending or done)

    @classmethod
    def in_dir(cls, checkpoint_dir: Path, comm: Collectives, cfg: CheckpointConfig) -> SaveCoordinator:
        """This rank's coordinator of the run's checkpoints (in `checkpoint_dir`, or under
        `checkpoint.uri`): the built-in loop's (trainers.checkpoint.recovery) and the run handle's (hpc.run) alike."""
        try:
            store = run_store(checkpoint_dir, cfg.uri)
        except StoreError as err:
            raise CheckpointError(f"checkpoint.uri: {err}") from None
        memory = MemoryCopies.from_env(store.url) if cfg.in_memory else None
        return cls(Checkpointer(store, comm.rank, comm.world_size, cfg.keep, memory), comm, cfg)

    def time_vote(self) -> float:
        """1 when this rank's clock says a timed save is due. Ranks leave a step's collective
        at slightly different moments, so each rank's own answer differs near the boundary:
        the votes ride on the step's allreduce and every rank saves when any voted (`due`)."""
        late = self.cfg.every_minutes is not None and time.monotonic() - self._last_save_time >= 60 * self.cfg.every_minutes
        return 1.0 if late else 0.0

    def due(self, step: int, time_votes: float) -> bool:
        """The same answer on every rank: the step count, and the summed `time_vote`s."""
        return (self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0) or time_votes > 0

    def written_flag(self) -> float:
        """1 when this rank has nothing in flight, for the per-step sum over ranks."""
        return 1.0 if self.checkpointer.written() else 0.0

    def on_step_boundary(self, ranks_written: float) -> None:
        if self.checkpointer.pending_step is not None and ranks_written >= self.comm.world_size:
            self.finish_pending()

    def finish_pending(self) -> None:
        """The pending save committed once every rank has written its part. A write the file
        system refused (trainers.faults) on any rank: every rank drops the save (no staging left)
        and raises the same StorageFailure. Any other error ends the job from the rank that met
        it, as ever (the others wait in the barrier until it does)."""
        step = self.checkpointer.pending_step
        if step is None:
            return
        refused: CheckpointError | None = None
        try:
            self.checkpointer.wait_written()
        except CheckpointError as err:
            if storage_error(err) is None:
                raise
            refused = err
        self.comm.barrier()  # every rank has written its part (or been refused): a barrier first, never a size another collective could match
        votes = torch.tensor([float(refused is not None)], dtype=torch.float64)
        self.comm.allreduce_(votes, op="max")  # who was refused, on every rank
        if votes[0] > 0:
            self.checkpointer.drop_pending(step)
            raise self.refused_save(step, refused)
        self._commit()
        share_own_copies(self.checkpointer, self.comm, step)  # a lost node's ranks get theirs from a peer

    def refused_save(self, step: int, refused: CheckpointError | None) -> Exception:
        """What every rank raises for a save of `step` a file system refused on some rank (the
        one collective of agreed_fault, on every rank)."""
        noted = FaultLatch()
        if refused is not None:
            noted.note(refused)
        found = agreed_fault(self.comm, noted.first, step)
        assert found is not None, "a storage vote from a rank that noted no fault"
        return found

    def drop_pending(self) -> None:
        """A pending save abandoned (the run ends on a fault): its staging removed on this rank."""
        self.checkpointer.drop_pending()

    def save(self, step: int, shared: Callable[[], dict[str, Any]], own: dict[str, Any], synchronous: bool, later: Callable[[Any], bool] | None = None) -> None:
        """`later`: the tensors only the next optimizer step changes, copied in the background
        (Checkpointer.begin_save); `fence()` must come before that step."""
        if step == self.last_step:  # e.g. a periodic save on the last step, then the final one:
            self.finish_pending()  # saving the same step twice would race on its directory
            return
        self.finish_pending()
        self.last_step = step
        rank0_state = shared() if self.comm.rank == 0 else None
        asynchronous = self.cfg.async_save and not synchronous
        self.checkpointer.begin_save(step, rank0_state, own, asynchronous, later)
        self._last_save_time = time.monotonic()
        if not asynchronous:
            self.finish_pending()

    def fence(self) -> float:
        """Before the optimizer step: the pending save's own copy of the state is complete."""
        return self.checkpointer.fence()

    def _commit(self) -> None:
        """Rank 0 publishes the save. A marker the file system refuses is noted (the next step's
        vote ends the run) and the step's directory removed: never a step without its marker."""
        step = self.checkpointer.pending_step
        try:
            path = self.checkpointer.commit()
        except OSError as err:
            if step is None or not FAULTS.note(err, self.checkpointer.store.staging(step).parent):
                raise
            self.checkpointer.remove_uncommitted(step)
            return
        if path is not None:
            log.info("checkpoint step %d committed: %s", step, path)
