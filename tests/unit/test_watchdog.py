"""The watchdog's rule for naming the rank that holds a job up, and its firing."""

from __future__ import annotations

import threading
import time

from trainers.watchdog import Heartbeat, Watchdog, describe_stall, read_heartbeats


def beat(rank: int, step: int, age_s: float, now: float = 1000.0) -> Heartbeat:
    return Heartbeat(rank=rank, step=step, host=f"node{rank // 2}", pid=100 + rank, time=now - age_s)


def test_a_silent_rank_is_named_over_the_ones_waiting_for_it():
    beats = [beat(0, 12, 1), beat(1, 12, 1), beat(2, 12, 30), beat(3, 12, 0.5)]
    assert describe_stall(beats, 4, now=1000.0, silent_after_s=5) == "rank 2 on node1 (pid 102) silent for 30 s after step 12"


def test_without_silent_ranks_the_lowest_step_is_named_and_missing_ranks_listed():
    beats = [beat(0, 12, 1), beat(1, 11, 1), beat(3, 12, 1)]
    assert describe_stall(beats, 4, now=1000.0, silent_after_s=5) == "rank 1 on node0 (pid 101) at step 11; never reported: ranks 2"


def test_watchdog_fires_once_without_steps_and_not_while_steps_come(tmp_path):
    fired: list[str] = []
    done = threading.Event()
    watchdog = Watchdog(0.4, tmp_path, rank=0, world_size=2, host="h", on_stall=lambda m: (fired.append(m), done.set()), poll_s=0.05).start()
    for step in range(1, 11):  # steps every 0.1 s: no stall
        watchdog.beat(step)
        assert not done.wait(0.1)
    assert done.wait(5), "the watchdog did not fire"
    watchdog.close()
    assert len(fired) == 1 and fired[0].startswith("watchdog: no step finished for") and "after step 10" in fired[0]
    assert "never reported: ranks 1" in fired[0]  # rank 1 never wrote a heartbeat here
    (mine,) = read_heartbeats(tmp_path)
    assert (mine.rank, mine.step, mine.host) == (0, 10, "h")


def test_start_up_has_its_own_allowance_then_the_step_timeout_applies(tmp_path):
    fired: list[tuple[str, float]] = []
    done = threading.Event()
    started = time.monotonic()
    watchdog = Watchdog(0.2, tmp_path, rank=0, world_size=1, host="h", poll_s=0.02, startup_s=0.8,
                        on_stall=lambda m: (fired.append((m, time.monotonic() - started)), done.set())).start()
    assert done.wait(5), "the start-up allowance never ran out"
    watchdog.close()
    ((message, after_s),) = fired
    assert message.startswith("watchdog: no first step after") and "timeout 0.8 s" in message
    assert after_s >= 0.8  # not the 0.2 s step timeout

    fired.clear()
    done.clear()
    watchdog = Watchdog(0.2, tmp_path, rank=0, world_size=1, host="h", poll_s=0.02, startup_s=60,
                        on_stall=lambda m: (fired.append((m, 0.0)), done.set())).start()
    watchdog.beat(1)  # the first step finished: from here on 0.2 s is the limit
    assert done.wait(5), "the step timeout did not apply after the first step"
    watchdog.close()
    assert fired[0][0].startswith("watchdog: no step finished for") and "after step 1" in fired[0][0]
