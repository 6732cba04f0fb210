"""The step boundary (trainers.boundary) on its own: the one buffer a step's end reduces, what
every rank reads from it (stop, save handshake, timed-save votes, metric names), and the save
and stop decisions taken from those sums, on one rank and on two (collectives.testing's
ThreadWorld: real sums across threads)."""

from __future__ import annotations

import errno
from dataclasses import dataclass, field

import pytest
import torch

from collectives.base import Deferred, SingleProcess
from collectives.testing import ThreadWorld
from trainers.boundary import HEAD, PendingVote, StepBoundary, packed
from trainers.context import Milestones
from trainers.faults import FaultLatch, StorageFailure
from trainers.preemption import StopFlag
from trainers.reporting import metricnames
from trainers.task import TaskError

NAMES = ("loss_sum", "correct")


@dataclass
class Coordinator:
    """SaveCoordinator's face to the boundary: what it was asked, and the answers it gives."""

    written: float = 1.0
    time: float = 0.0
    every_steps: int = 0
    boundaries: list[float] = field(default_factory=list)
    saves: list[tuple[int, dict, dict, bool, object]] = field(default_factory=list)
    due_asked: list[tuple[int, float]] = field(default_factory=list)
    phase_seen: list[str] = field(default_factory=list)
    stop: StopFlag | None = None
    pruned_waits: int = 0
    fail_save: bool = False
    dropped: bool = False

    def written_flag(self) -> float:
        return self.written

    def time_vote(self) -> float:
        return self.time

    def on_step_boundary(self, ranks_written: float) -> None:
        self.boundaries.append(ranks_written)

    def due(self, step: int, time_votes: float) -> bool:
        self.due_asked.append((step, time_votes))
        return (self.every_steps > 0 and step % self.every_steps == 0) or time_votes > 0

    def save(self, step, shared, own, synchronous, later=None) -> None:  # noqa: ANN001 - SaveCoordinator.save's shape
        if self.stop is not None:
            self.phase_seen.append(self.stop.phase)
        self.saves.append((step, shared(), own, synchronous, later))
        if self.fail_save:
            raise OSError("disk full")

    @property
    def checkpointer(self) -> Coordinator:
        return self

    def wait_pruned(self) -> None:
        self.pruned_waits += 1

    def drop_pending(self) -> None:
        self.dropped = True


@dataclass
class Beats:
    steps: list[int] = field(default_factory=list)

    def beat(self, step: int) -> None:
        self.steps.append(step)


def boundary(comm, coordinator: Coordinator | None = None, **kwargs) -> StepBoundary:  # noqa: ANN001 - any Collectives
    return StepBoundary(comm, StopFlag(), coordinator, **kwargs)  # type: ignore[arg-type]  # the fake coordinator


def test_packed_keeps_every_value_in_order_as_float64_whatever_its_type():
    big = 2**40 + 1  # exact in float64, not in float32: must not pass through float32 on its way
    values = [
        torch.tensor(big, dtype=torch.int64),
        2.5,
        torch.tensor([0.25], dtype=torch.float32),
        torch.tensor(7, dtype=torch.int32),
        3,
        torch.tensor(1.5, requires_grad=True) * 2,
    ]
    buffer = packed([1.0, 0.0, 1.0], values)
    assert buffer.dtype == torch.float64 and buffer.device.type == "cpu" and not buffer.requires_grad
    assert buffer.tolist() == [1.0, 0.0, 1.0, float(big), 2.5, 0.25, 7.0, 3.0, 3.0]
    assert packed([4.0], []).tolist() == [4.0]  # numbers alone: one part
    assert packed([], [torch.tensor(2.0)]).tolist() == [2.0]  # tensors alone: one part


def test_a_world_of_one_reduces_nothing_and_reads_its_own_numbers():
    class NoReduce(SingleProcess):
        def allreduce_(self, buffer, op="sum"):  # noqa: ANN001
            raise AssertionError("a world of one must not reduce")

        allreduce_async = allreduce_

    for overlap in (True, False):
        pending = PendingVote.launch(NoReduce(), 3, NAMES, 0.5, [1.0, 1.0, 0.0, 0.0, 5.0, 6.0, 7.0, 8.0], [2.0, torch.tensor(4.0)], overlap)
        vote = pending.read()
        assert (pending.step, pending.names, pending.step_s) == (3, NAMES, 0.5)
        assert (vote.stop_votes, vote.ranks_written, vote.time_votes, vote.names, vote.values) == (1.0, 1.0, 0.0, (5.0, 6.0, 7.0, 8.0), [2.0, 4.0])


@pytest.mark.parametrize("overlap", [True, False])
def test_two_ranks_read_the_same_sums_and_stop_together_at_one_ranks_signal(overlap):
    def rank(comm):  # noqa: ANN001
        coordinator = Coordinator(written=float(comm.rank == 0), time=float(comm.rank == 1))
        step_end = boundary(comm, coordinator)
        if comm.rank == 1:
            step_end.stop.note("SIGUSR1", 0.0, "training")
        vote = step_end.settle(step_end.launch(4, NAMES, [torch.tensor(float(comm.rank + 1)), 10.0 * (comm.rank + 1)], overlap=overlap))
        return vote, step_end.stopped_by(vote), coordinator.boundaries, step_end.save_due(4, vote), coordinator.due_asked

    results = ThreadWorld(2).run(rank)
    for rank_no, (vote, stopped, boundaries, due, asked) in enumerate(results):
        assert (vote.stop_votes, vote.ranks_written, vote.time_votes, vote.values) == (1.0, 1.0, 1.0, [3.0, 30.0])
        assert vote.names == tuple(2 * part for part in metricnames.fingerprint(NAMES)) and len(vote.names) == HEAD - 4
        assert stopped == ("a signal on another rank" if rank_no == 0 else "SIGUSR1")  # named by the rank's own signal
        assert boundaries == [1.0]  # the save handshake hears how many ranks have written
        assert due and asked == [(4, 1.0)]  # one rank's clock voted: every rank saves


def test_no_stop_and_no_vote_goes_on():
    step_end = boundary(SingleProcess(), Coordinator(every_steps=5))
    vote = step_end.settle(step_end.launch(3, NAMES, [1.0, 2.0]))
    assert step_end.stopped_by(vote) is None and not step_end.save_due(3, vote) and step_end.save_due(5, vote) and step_end.save_due(5, None)
    assert not boundary(SingleProcess()).save_due(5, vote)  # no checkpointing: never a save


def test_names_that_change_alike_on_every_rank_are_refused_against_the_agreed_ones():
    def rank(comm):  # noqa: ANN001
        step_end = boundary(comm)
        with pytest.raises(TaskError, match=r"the metric names changed at step 7: every rank reports 'extra'"):
            step_end.settle(step_end.launch(7, (*NAMES, "extra"), [1.0, 2.0, 3.0]), expected=NAMES)
        return step_end.settle(step_end.launch(8, NAMES, [1.0, 2.0]), expected=NAMES).values

    assert ThreadWorld(2).run(rank) == [[2.0, 4.0], [2.0, 4.0]]


def test_names_that_differ_across_ranks_are_refused_on_every_rank_naming_the_rank():
    def rank(comm):  # noqa: ANN001
        step_end = boundary(comm)
        names = NAMES if comm.rank == 0 else ("loss_sum", "hits")
        with pytest.raises(TaskError, match=r"at step 2: rank 1 reports 'hits', which rank 0 does not"):
            step_end.settle(step_end.launch(2, names, [1.0, 2.0]))
        return True

    assert ThreadWorld(2).run(rank) == [True, True]


def test_a_stop_before_the_first_step_is_agreed_by_every_rank():
    def rank(comm):  # noqa: ANN001
        step_end = boundary(comm)
        if comm.rank == 0:
            step_end.stop.note("SIGTERM", 0.0, "start-up")
        return step_end.stop_agreed()

    assert ThreadWorld(2).run(rank) == ["SIGTERM", "a signal on another rank"]
    assert ThreadWorld(2).run(lambda comm: boundary(comm).stop_agreed()) == [None, None]


def test_a_save_names_its_phase_while_it_runs_and_restores_it_after_even_when_it_fails():
    coordinator = Coordinator()
    step_end = boundary(SingleProcess(), coordinator)
    coordinator.stop = step_end.stop
    step_end.stop.phase = "training"
    later = object()
    step_end.save(6, lambda: {"shared": 1}, lambda: {"own": 2}, synchronous=False, later=later)  # type: ignore[arg-type]
    step_end.save(7, lambda: {"shared": 3}, lambda: {"own": 4}, synchronous=True)
    assert coordinator.saves == [(6, {"shared": 1}, {"own": 2}, False, later), (7, {"shared": 3}, {"own": 4}, True, None)]
    assert coordinator.phase_seen == ["an asynchronous save", "the final save"] and step_end.stop.phase == "training"
    coordinator.fail_save = True
    with pytest.raises(OSError, match="disk full"):
        step_end.save(8, dict, dict, synchronous=True)
    assert step_end.stop.phase == "training"
    step_end.close()
    assert coordinator.pruned_waits == 1
    nothing = boundary(SingleProcess())
    nothing.save(9, dict, lambda: pytest.fail("no checkpointing: nothing is gathered"), synchronous=True)
    nothing.close()


def test_a_finished_step_reaches_the_watchdog_and_the_first_step_the_timeline():
    seen: list[dict] = []
    beats = Beats()
    step_end = boundary(SingleProcess(), watchdog=beats, milestones=Milestones(seen.append))  # type: ignore[arg-type]  # the watchdog's face
    step_end.stepped(11, 10)
    step_end.stepped(12, 10)
    assert beats.steps == [11, 12]
    assert [(times["first_step_no"], times["resumed_from"]) for times in seen] == [(11, 10)]
    boundary(SingleProcess()).stepped(1, None)  # no watchdog: nothing to beat


class Recorded(SingleProcess):
    """A world of two seen from one rank, the other rank's buffer equal to this one's: every sum
    doubles. The asynchronous reduction happens only when waited for, as on a real backend, and
    every call is recorded."""

    world_size = 2

    def __init__(self) -> None:
        self.calls: list[str] = []

    def allreduce_(self, buffer: torch.Tensor, op: str = "sum") -> None:  # type: ignore[override]
        self.calls.append("allreduce_")
        buffer.mul_(2)

    def allreduce_async(self, buffer: torch.Tensor, op: str = "sum") -> Deferred:  # type: ignore[override]
        self.calls.append("allreduce_async")
        return Deferred(lambda: buffer.mul_(2))


def test_the_run_handles_vote_overlaps_its_next_step_and_the_loops_is_reduced_at_once():
    for overlap, call in ((True, "allreduce_async"), (False, "allreduce_")):
        comm = Recorded()
        vote = boundary(comm).launch(5, NAMES, [1.0, torch.tensor(3.0)], overlap=overlap).read()
        assert comm.calls == [call] and vote.values == [2.0, 6.0]  # read waits for the sums
    comm = Recorded()
    pending = boundary(comm).launch(5, NAMES, [1.0])  # the run handle's call: overlapped by default
    assert comm.calls == ["allreduce_async"] and pending.step_s == 0.0 and pending.read().values == [2.0]


def test_without_checkpointing_every_rank_counts_as_written_and_votes_no_timed_save():
    vote = boundary(Recorded()).launch(1, NAMES, [], overlap=False).read()
    assert (vote.ranks_written, vote.time_votes, vote.stop_votes) == (2.0, 0.0, 0.0)


def test_values_on_another_device_gather_there_with_the_cpu_ones_copied_over():
    """The meta device stands in for a GPU: a step's figures stay where they were computed, and
    a CPU tensor beside them is moved to them, not the other way."""
    buffer = packed([1.0], [torch.tensor(2.0), torch.tensor(3.0, device="meta"), 4.0])
    assert buffer.device.type == "meta" and buffer.dtype == torch.float64 and buffer.shape == (4,)


def test_a_write_refused_on_one_rank_ends_every_rank_at_that_step_with_its_line(tmp_path):
    """Rank 1's file system said no (ENOSPC writing its heartbeat): the next vote raises the same
    StorageFailure on both ranks at that step, rank 1's line (rank 0's names the rank), the save
    in flight dropped; before that, the vote goes on as usual."""
    written = tmp_path / "heartbeats" / "rank-1.json"

    def rank(comm):  # noqa: ANN001
        coordinator = Coordinator()
        step_end = boundary(comm, coordinator, faults=FaultLatch())
        quiet = step_end.settle(step_end.launch(3, NAMES, [1.0, 2.0]))
        if comm.rank == 1:
            assert step_end.faults.note(OSError(errno.ENOSPC, "No space left on device"), written)
        try:
            step_end.settle(step_end.launch(4, NAMES, [1.0, 2.0]))
        except StorageFailure as err:
            return quiet.fault_votes, err, coordinator.dropped, coordinator.boundaries
        raise AssertionError("the vote after a refused write went on")

    for rank_no, (quiet, err, dropped, boundaries) in enumerate(ThreadWorld(2).run(rank)):
        assert quiet == 0.0 and err.step == 4 and err.rank == 1 and err.reason == "disk full" and dropped
        assert err.line.startswith("no space left on /") and f"writing {written}" in err.line, err.line
        assert err.line.endswith(" (rank 1)") == (rank_no == 0), err.line
        assert boundaries == [2.0]  # the step before the fault only: the fault's step commits nothing
