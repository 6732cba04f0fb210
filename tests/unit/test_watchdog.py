"""The watchdog's rule for naming the rank that holds a job up, and its firing."""

from __future__ import annotations

import threading

from trainers.watchdog import Heartbeat, Watchdog, describe_stall, read_heartbeats


def beat(rank: int, step: int, age_s: float, now: float = 1000.0) -> Heartbeat:
    return Heartbeat(rank=rank, step=step, host=f"node{rank // 2}", pid=100 + rank, time=now - age_s)


def test_a_silent_rank_is_named_over_the_ones_waiting_for_it():
    beats = [beat(0, 12, 1), beat(1, 12, 1), beat(2, 12, 30), beat(3, 12, 0.5)]
    assert describe_stall(beats, 4, now=1000.0, silent_after_s=5) == "rank 2 on node1 (pid 102) silent for 30 s"


def test_without_silent_ranks_the_lowest_step_is_named_and_missing_ranks_listed():
    beats = [beat(0, 12, 1), beat(1, 11, 1), beat(3, 12, 1)]
    assert describe_stall(beats, 4, now=1000.0, silent_after_s=5) == "rank 1 on node0 (pid 101) at step 11; never reported: ranks 2"


def test_a_rank_that_left_the_loop_is_named_first_and_read_back_from_its_heartbeat(tmp_path):
    beats = [beat(0, 5, 1), Heartbeat(rank=1, step=5, host="node0", pid=101, time=999.0, left="left the loop"), beat(2, 5, 30)]
    assert describe_stall(beats, 3, now=1000.0, silent_after_s=5) == "rank 1 on node0 (pid 101) left the loop after step 5"
    dog = Watchdog(60, tmp_path, 1, 2, "node0", on_stall=lambda message: None)
    dog.beat(4)
    dog.leave("left the loop")
    (read,) = read_heartbeats(tmp_path)
    assert (read.rank, read.step, read.left) == (1, 4, "left the loop")


class FakeClock:
    """The watchdog's monotonic clock, moved by the test: no outcome depends on the machine's load.
    Steps are binary fractions, so "exactly the timeout" is exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_stays_quiet_while_steps_come_and_fires_past_the_timeout(tmp_path):
    clock = FakeClock()
    watchdog = Watchdog(0.5, tmp_path, rank=0, world_size=2, host="h", on_stall=lambda m: None, poll_s=0.05, clock=clock)
    for step in range(1, 11):  # a step every 0.375 s: never 0.5 s without one
        clock.now += 0.375
        assert watchdog.check() is None
        watchdog.beat(step)
    clock.now += 0.5  # exactly the timeout: not yet
    assert watchdog.check() is None
    clock.now += 0.125
    message = watchdog.check()
    assert message is not None and message.startswith("watchdog: no step finished for 1 s (timeout 0.5 s) after step 10; behind: ")
    assert "never reported: ranks 1" in message  # rank 1 never wrote a heartbeat here
    (mine,) = read_heartbeats(tmp_path)
    assert (mine.rank, mine.step, mine.host) == (0, 10, "h")


def test_the_watchdog_thread_reports_a_stall_once_and_stops(tmp_path):
    clock = FakeClock()
    fired: list[str] = []
    done = threading.Event()
    watchdog = Watchdog(0.5, tmp_path, rank=0, world_size=1, host="h", on_stall=lambda m: (fired.append(m), done.set()), poll_s=0.01, clock=clock)
    watchdog.beat(3)
    clock.now += 5.0  # long past the timeout before the thread's first poll
    watchdog.start()
    assert done.wait(60), "the watchdog thread did not fire"  # a hang guard, not a timing
    watchdog._thread.join(10)
    assert not watchdog._thread.is_alive(), "the thread polls on after firing"
    watchdog.close()
    assert len(fired) == 1 and fired[0].startswith("watchdog: no step finished for 5 s (timeout 0.5 s) after step 3")


def test_start_up_has_its_own_allowance_then_the_step_timeout_applies(tmp_path):
    clock = FakeClock()
    watchdog = Watchdog(0.25, tmp_path, rank=0, world_size=1, host="h", on_stall=lambda m: None, poll_s=0.02, startup_s=1.0, clock=clock)
    clock.now += 1.0  # four step timeouts, exactly the start-up allowance: not yet
    assert watchdog.check() is None
    clock.now += 0.125
    message = watchdog.check()
    assert message is not None and message.startswith("watchdog: no first step after 1 s of start-up (timeout 1 s)")

    watchdog = Watchdog(0.25, tmp_path, rank=0, world_size=1, host="h", on_stall=lambda m: None, poll_s=0.02, startup_s=60, clock=clock)
    watchdog.beat(1)  # the first step finished: from here on 0.25 s is the limit
    clock.now += 0.25
    assert watchdog.check() is None
    clock.now += 0.125
    message = watchdog.check()
    assert message is not None and message.startswith("watchdog: no step finished for 0 s (timeout 0.25 s) after step 1")
