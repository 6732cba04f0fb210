"""trainers.reporting.metricnames in isolation: the fingerprint every step carries (exact in float64 over
up to 2^13 ranks, spread over its bits), and `agree` where no rank has names to report. The run
handle's and the loop's mismatches end to end: tests/unit/test_run_handle.py, test_task_seam.py."""

from __future__ import annotations

import random
import string

import pytest

from collectives.testing import ThreadWorld
from trainers.reporting.metricnames import agree, changed_line, fingerprint, fingerprints_agree
from trainers.task import TaskError

RANKS_BOUND = 2**13  # the docstring's promise


def random_names(draw: random.Random) -> tuple[str, ...]:
    return tuple("".join(draw.choices(string.ascii_lowercase, k=draw.randint(1, 12))) for _ in range(draw.randint(1, 6)))


def test_the_fingerprint_is_two_hashes_and_their_squares_spread_over_20_bits_and_exact_summed_over_8192_ranks():
    draw = random.Random(0)
    lists = {random_names(draw) for _ in range(300)}
    prints = [fingerprint(names) for names in lists]
    for first, first_squared, second, second_squared in prints:
        assert first.is_integer() and second.is_integer() and (first_squared, second_squared) == (first**2, second**2)
        assert 0 <= first < 2**20 and 0 <= second < 2**20
        assert first_squared * RANKS_BOUND < 2**53 and second_squared * RANKS_BOUND < 2**53  # float64 sums stay exact
    # Each hash uses its whole range: two lists that differ collide rarely (1 in 2^40 for both)
    assert max(p[0] for p in prints) >= 2**19 and max(p[2] for p in prints) >= 2**19
    assert len({(p[0], p[2]) for p in prints}) == len(lists) > 250


def test_the_step_check_agrees_only_on_world_size_times_ones_own_and_refuses_a_short_buffer():
    names = ("loss", "correct")
    own = fingerprint(names)
    assert fingerprints_agree([3 * value for value in own], names, 3)
    assert not fingerprints_agree([3 * value for value in fingerprint(("loss",))], names, 3)
    with pytest.raises(ValueError, match="zip"):  # a buffer cut short is a bug, never a silent pass
        fingerprints_agree([3 * value for value in own[:3]], names, 3)


def test_ranks_with_no_names_take_the_others_and_none_anywhere_is_no_names():
    def rank(comm, names_by_rank):
        return agree(comm, names_by_rank[comm.rank], "step 1")

    assert ThreadWorld(3, timeout_s=60).run(lambda comm: rank(comm, [None, ("loss",), None])) == [("loss",)] * 3
    assert ThreadWorld(2, timeout_s=60).run(lambda comm: rank(comm, [None, None])) == [(), ()]
    assert ThreadWorld(2, timeout_s=60).run(lambda comm: rank(comm, [(), ()])) == [(), ()]  # reported, empty: not "none"


def test_a_difference_on_any_rank_is_named_by_its_key_and_rank_whatever_the_names_lengths():
    def rank(comm, names_by_rank):
        return agree(comm, names_by_rank[comm.rank], "step 3")

    cases = [
        ([("loss",), ("loss", "recall_7"), ("loss",)], "rank 1 reports 'recall_7', which rank 0 does not"),
        ([("loss", "acc"), ("loss", "acc"), ("loss",)], "rank 0 reports 'acc', which rank 2 does not"),
        ([("a", "b"), ("b", "a")], "ranks 0 and 1 report them in another order"),
    ]
    for names_by_rank, message in cases:
        with pytest.raises(TaskError, match=f"the metric names differ across ranks at step 3: {message}"):
            ThreadWorld(len(names_by_rank), timeout_s=60).run(lambda comm, names_by_rank=names_by_rank: rank(comm, names_by_rank))


def test_names_changed_alike_on_every_rank_are_named_as_added_or_dropped():
    assert "every rank reports 'aux', which the first step did not" in changed_line(9, ("loss",), ("loss", "aux"))
    assert "no rank reports 'aux' any more" in changed_line(9, ("loss", "aux"), ("loss",))
    assert changed_line(9, ("loss",), ("loss", "aux")).startswith("the metric names changed at step 9: ")
