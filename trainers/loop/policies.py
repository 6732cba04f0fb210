"""The step policies: what a step's sums, and the host's own counts, call for after it. The stop
vote and the save handshake (trainers.boundary), non-finite steps and rollback (trainers.guard),
stragglers (trainers.stragglers), max_steps, a range to skip, evaluation every N steps. Every rank
reads the same sums at the same step, so every rank decides the same."""

from __future__ import annotations

from dataclasses import dataclass

from trainers.boundary import StepBoundary, StepVote
from trainers.checkpoint.state import Progress
from trainers.guard import BadStepGuard, skip_starts_here
from trainers.loop.records import PassEnd, StepSums
from trainers.stragglers import StragglerWatch


@dataclass
class StepPolicies:
    """The decisions taken between steps, and the watchers they read."""

    boundary: StepBoundary  # the stop vote, the save handshake, saving: as in the run handle
    guard: BadStepGuard
    watch: StragglerWatch
    max_steps: int | None = None
    eval_every: int | None = None

    def at_max_steps(self, step: int) -> bool:
        return self.max_steps is not None and step >= self.max_steps

    def evaluates_at(self, step: int) -> bool:
        return bool(self.eval_every and step % self.eval_every == 0)

    def must_decide(self, step: int, progress: Progress, read: list[StepSums]) -> bool:
        """Whether anything is to be done after `step`: the host's counts (max_steps, a range to
        skip, an evaluation or a save by step count) or the sums read (a stop, a timed save, a rollback)."""
        return (
            self.at_max_steps(step)
            or self.guard.must_roll_back
            or skip_starts_here(progress)
            or self.evaluates_at(step)
            or any(sums.vote.stop_votes > 0 for sums in read)
            or self.boundary.save_due(step, read[-1].vote if read else None)
        )

    def ends_pass(self, votes: list[StepVote], progress: Progress, ended: PassEnd) -> bool:
        """A stop agreed, max_steps reached, a rollback due or a range to skip starting here: the
        pass ends (`ended` says why, for fit())."""
        ended.stopped_by = next((stop for vote in votes if (stop := self.boundary.stopped_by(vote))), None)
        if ended.stopped_by or self.at_max_steps(progress.step):
            return True
        if self.guard.must_roll_back:
            ended.rollback = self.guard.bad_range(progress)
            return True
        return skip_starts_here(progress)  # fit() starts a new pass past it

    def save_due(self, step: int, votes: list[StepVote]) -> bool:
        return any(self.boundary.save_due(step, vote) for vote in votes)
