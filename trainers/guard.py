"""Non-finite steps: skip the update, count it, and after too many in a row roll back.

Gradients are checked after they are averaged, so every rank sees the same verdict without a
collective of its own. A skipped step still advances the step counter, the LR schedule and the
data position (as GradScaler's skipped fp16 steps do). After `max_bad` skipped steps in a row,
the model goes back to the last committed checkpoint and the data of those steps, recorded in
`Progress.skip` (kept in every later checkpoint), is never trained on again.
"""

from __future__ import annotations

from trainers.checkpoint.state import Progress


def skip_past(progress: Progress) -> bool:
    """Move the data position past every skipped range it stands in (ranges recorded by
    successive rollbacks adjoin: the end of one is the start of the next); True when it moved."""
    moved = False
    while inside := next((end for epoch, start, end in progress.skip if epoch == progress.epoch and start <= progress.position < end), None):
        progress.position, moved = inside, True
    return moved


def in_skipped_range(progress: Progress) -> bool:
    """The data position stands inside a range recorded to skip."""
    return any(e == progress.epoch and start <= progress.position < end for e, start, end in progress.skip)


def skip_starts_here(progress: Progress) -> bool:
    """A range to skip starts at the data position: the pass ends here, the next starts past it."""
    return any(e == progress.epoch and start == progress.position for e, start, _ in progress.skip)


class DivergedError(RuntimeError):
    """Rolling back cannot help: the checkpoint itself leads straight to non-finite steps."""


ROLLBACKS_PER_CHECKPOINT = 3  # more to the same checkpoint: its weights are the problem, not the data


class BadStepGuard:
    def __init__(self, max_bad: int) -> None:
        self.max_bad = max_bad  # 0: never roll back, only skip
        self.in_a_row = 0
        self._first_position = 0
        self._bad_end: int | None = None  # where the data of the bad steps in a row ends, once they are too many
        self._rolled_back_to: int | None = None  # the checkpoint step of the last rollback
        self._rollbacks_to_it = 0
        self._finite_since_rollback = False
        self._skipped_unsaved = False  # a bad range was skipped with no checkpoint to go back to

    def record(self, finite: bool, progress: Progress, position_before: int, position_after: int) -> None:
        """A step's verdict, read after the step (the loop reads it a step late: the range to skip
        is the bad steps' own data, `position_before` to `position_after` of each)."""
        if finite:
            if self._bad_end is None:  # a step after too many bad ones is rolled back with them: it proves nothing
                self.in_a_row, self._finite_since_rollback = 0, True
            return
        if self.in_a_row == 0:
            self._first_position = position_before
        self.in_a_row += 1
        progress.bad_steps += 1
        if self._bad_end is None and self.max_bad > 0 and self.in_a_row >= self.max_bad:
            self._bad_end = position_after  # kept until the rollback: a later step's verdict does not move it

    @property
    def must_roll_back(self) -> bool:
        return self._bad_end is not None

    def bad_range(self, progress: Progress) -> list[int]:
        """[epoch, start, end): the data of the bad steps in a row, to be skipped from now on."""
        assert self._bad_end is not None, "bad_range() before too many bad steps in a row"
        return [progress.epoch, self._first_position, self._bad_end]

    def rolled_back(self, to_step: int) -> None:
        """After a rollback to checkpoint `to_step`. Rolling back to the same checkpoint again
        with no finite step in between, or more than ROLLBACKS_PER_CHECKPOINT times, would go on
        forever (the checkpoint's own weights diverge, whatever data follows): DivergedError
        instead, which ends the job with one line."""
        again = to_step == self._rolled_back_to
        self._rollbacks_to_it = self._rollbacks_to_it + 1 if again else 1
        if again and (not self._finite_since_rollback or self._rollbacks_to_it > ROLLBACKS_PER_CHECKPOINT):
            before = self._rollbacks_to_it - 1
            raise DivergedError(
                f"training diverged: the steps after checkpoint step {to_step} keep going non-finite, also after {before} rollback{'s' * (before > 1)} to it; "
                "lower optim.lr, set trainer.clip_grad_norm, or check the data (a new run dir starts afresh)"
            )
        self._rolled_back_to, self._finite_since_rollback = to_step, False
        self.reset()

    def skipped_without_checkpoint(self) -> None:
        """No checkpoint to go back to: the bad range is skipped and training goes on from the
        weights it has (no update was applied from a bad step). But when not one step was finite
        since the last such skip, the weights or the learning rate are the problem, not the data:
        skipping on would run the epochs empty and call it completed. DivergedError instead."""
        if self._skipped_unsaved and not self._finite_since_rollback:
            raise DivergedError(
                f"training diverged: {2 * self.max_bad} steps in a row went non-finite before any checkpoint, on different data; "
                "lower optim.lr, set trainer.clip_grad_norm, or check the model and the data"
            )
        self._skipped_unsaved, self._finite_since_rollback = True, False
        self.reset()

    def reset(self) -> None:
        self.in_a_row, self._bad_end = 0, None
