"""Rank 0 says a script's run completed only once every rank of this start has (hpc.rank.outcomes);
an earlier start's markers in a resumed run dir count for nothing."""

from __future__ import annotations

import json

from hpc.rank.outcomes import START_SKEW_S, marker, record_end, record_failure, wait_for_peers
from hpc.rundir import RunDir


def test_rank_0_waits_for_every_rank_of_this_start_and_names_a_failure(tmp_path):
    run = RunDir(tmp_path)
    started = 1_000.0
    record_failure(run, 1, 3, started - START_SKEW_S - 60, ValueError("from yesterday's start"))  # stale: ignored
    record_end(run, 0, started, "completed")
    waited: list[int] = []

    def meanwhile(_: float) -> None:  # the other ranks end while rank 0 polls
        waited.append(1)
        if len(waited) == 2:
            record_end(run, 2, started + 0.5, "completed")
        if len(waited) == 4:
            record_end(run, 1, started - 1.0, "completed")  # within the skew of one start

    assert wait_for_peers(run, 3, started, sleep=meanwhile) is None and len(waited) == 4
    record_end(run, 1, started, "stopped")  # its script was stopped as it ended: the run stops
    assert wait_for_peers(run, 3, started, sleep=meanwhile) == (1, "stopped", "")
    record_failure(run, 2, 3, started + 0.2, ValueError("bad shard\nsecond line"))  # a failure comes first
    assert wait_for_peers(run, 3, started, sleep=meanwhile) == (2, "failed", "ValueError: bad shard")
    result = json.loads(run.result.read_text())
    assert (result["status"], result["failed_rank"], result["error"], result["exit_code"]) == ("failed", 2, "ValueError: bad shard", 1)
    assert json.loads(marker(run, 2).read_text())["status"] == "failed" and not list(tmp_path.rglob("*.tmp"))


def test_a_start_resumed_at_once_never_reads_the_word_a_rank_left_at_the_last(tmp_path):
    """Stopped and resumed within START_SKEW_S (fast imports): rank 1's `stopped` of the last start
    would pass for this start's; each rank forgets its word before its script runs."""
    from hpc.rank.outcomes import forget_end, peers_said

    run_dir = RunDir(tmp_path)
    record_end(run_dir, 1, 100.0, "stopped")  # the last start
    assert 1 in peers_said(run_dir, 2, 101.0)  # within the skew: taken for this start's
    forget_end(run_dir, 1)  # rank 1 of this start, before its script
    record_end(run_dir, 0, 101.0, "completed")
    assert peers_said(run_dir, 2, 101.0).keys() == {0}  # rank 0 waits for rank 1's word of this start
    record_end(run_dir, 1, 101.0, "completed")
    assert wait_for_peers(run_dir, 2, 101.0, sleep=lambda _: None) is None
    forget_end(run_dir, 1)
    forget_end(run_dir, 1)  # nothing to forget: no error
    assert not marker(run_dir, 1).exists()
