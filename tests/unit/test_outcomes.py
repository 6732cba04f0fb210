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
