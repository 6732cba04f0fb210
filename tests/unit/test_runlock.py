"""One start of a local run at a time (hpc.runlock): a second launcher, or a launcher while
ranks of an earlier start still run, is refused; a process's end lets go, however it ends."""

from __future__ import annotations

import pytest

from hpc.runlock import RunDirBusy, hold_launch, hold_rank, ranks_running, release_all
from tests.support.runs import holding


def test_a_second_launcher_is_refused_while_the_first_runs_and_welcome_after(tmp_path):
    first = holding("hold_launch", tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=r"is running already; stop it first \(python -m hpc.stop .*\) or wait for its end"):
            hold_launch(tmp_path)
    finally:
        first.kill()
        first.wait()
    hold_launch(tmp_path)  # killed: the kernel let go of its lock
    release_all()


def test_ranks_that_outlive_their_launcher_still_count_as_running(tmp_path):
    assert not ranks_running(tmp_path)  # never started
    rank = holding("hold_rank", tmp_path)
    try:
        hold_rank(tmp_path)  # every rank holds it: shared
        assert ranks_running(tmp_path)
        release_all()
        assert ranks_running(tmp_path)  # the other process's still
        with pytest.raises(RunDirBusy, match="ranks of an earlier start of .* still run"):
            hold_launch(tmp_path)
    finally:
        rank.kill()
        rank.wait()
    assert not ranks_running(tmp_path)
    hold_launch(tmp_path)
    release_all()


def test_a_rank_that_cannot_make_the_lock_file_runs_unlocked_rather_than_raising(tmp_path):
    """hold_rank comes before the rank's error reporting: a run dir it cannot write to must fail
    later, where the rank reports in one line, not here with a traceback."""
    hold_rank(tmp_path / "gone")  # no such directory: open() fails
    assert not ranks_running(tmp_path / "gone")
