"""auto's tuning table: estimates between tuned sizes, the fastest eligible choice, and files that
cannot be trusted (edited, truncated, another job's shape) measured again, never used."""

import json
import logging
import math

import pytest

from collectives.tuning import FORMAT, TuningError, TuningTable, cache_file, default_cache_dir, host_type, read_table, tuning_key, write_table

KEY = tuning_key("Xeon x2", 2, (), "Open MPI v4.1.4", ["mpi", "rhd", "ring"])
SIZES = (1 << 10, 1 << 20, 1 << 26)


def table(**seconds) -> TuningTable:
    return TuningTable(KEY, SIZES, {name: tuple(times) for name, times in seconds.items()})


def test_estimates_interpolate_in_log_log_and_scale_beyond_the_largest_size():
    t = table(ring=(1e-4, 1e-3, 1e-1))
    assert t.estimate("ring", 1 << 10) == pytest.approx(1e-4)
    assert t.estimate("ring", 8) == pytest.approx(1e-4)  # below the ladder: its first time
    middle = 1 << 15  # halfway between 1 KiB and 1 MiB in log2
    assert t.estimate("ring", middle) == pytest.approx(math.sqrt(1e-4 * 1e-3))
    assert t.estimate("ring", 1 << 27) == pytest.approx(2e-1)  # twice the largest: twice the time


def test_the_fastest_eligible_algorithm_wins_at_each_size():
    t = table(mpi=(1e-5, 9e-4, 9e-2), rhd=(2e-5, 5e-4, 8e-2), ring=(3e-5, 6e-4, 5e-2))
    assert [t.fastest(n, ["mpi", "rhd", "ring"]) for n in (1 << 10, 1 << 20, 1 << 26)] == ["mpi", "rhd", "ring"]
    assert t.fastest(1 << 10, ["rhd", "ring"]) == "rhd"  # bfloat16: MPI cannot sum it
    assert t.fastest(1 << 10, ["hierarchical"]) is None  # not in the table: the caller falls back


def test_a_tie_goes_to_the_first_eligible():
    t = table(mpi=(1.0, 1.0, 1.0), rhd=(1.0, 1.0, 1.0))
    assert t.fastest(1 << 20, ["rhd", "mpi"]) == "rhd"


def test_tables_round_trip_through_json_and_refuse_another_key():
    t = table(mpi=(1e-5, 1e-3, 1e-1), ring=(2e-5, 2e-3, 2e-2))
    assert TuningTable.from_json(t.to_json(), KEY) == t
    with pytest.raises(TuningError, match="another job shape"):
        TuningTable.from_json(t.to_json(), tuning_key("Xeon x2", 4, (2, 2), "Open MPI v4.1.4", ["mpi", "rhd", "ring", "hierarchical"]))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format=FORMAT + 1), "older engine"),
        (lambda d: d["seconds"].update(ring=[1.0]), "one positive time per size"),
        (lambda d: d["seconds"].update(ring=[1.0, -1.0, 2.0]), "one positive time per size"),
        (lambda d: d["seconds"].update(ring=[1.0, float("nan"), 2.0]), "one positive time per size"),
        (lambda d: d.update(sizes=[8, 4, 2]), "increasing"),
        (lambda d: d.pop("sizes"), "not a tuning table"),
        (lambda d: d.update(seconds={}), "one positive time per size"),
    ],
)
def test_edited_tables_are_refused(edit, message):
    data = json.loads(table(ring=(1.0, 2.0, 3.0)).to_json())
    edit(data)
    with pytest.raises(TuningError, match=message):
        TuningTable.from_json(json.dumps(data), KEY)


def test_keys_tell_shapes_apart():
    keys = {
        tuning_key("Xeon x2", 4, (), "Open MPI", ["mpi", "ring"]),
        tuning_key("Xeon x2", 4, (2, 2), "Open MPI", ["mpi", "ring"]),
        tuning_key("Xeon x2", 4, (3, 1), "Open MPI", ["mpi", "ring"]),
        tuning_key("EPYC x64", 4, (), "Open MPI", ["mpi", "ring"]),
        tuning_key("Xeon x2", 2, (), "Open MPI", ["mpi", "ring"]),
        tuning_key("Xeon x2", 4, (), "MPICH", ["mpi", "ring"]),
    }
    assert len(keys) == 6 and len({cache_file("/c", k) for k in keys}) == 6


def test_a_damaged_or_foreign_file_is_warned_about_and_not_used(tmp_path, caplog):
    path = tmp_path / "t.json"
    assert read_table(path, KEY) is None  # none yet: quietly measured
    path.write_text("{ truncated")
    with caplog.at_level(logging.WARNING, logger="collectives"):
        assert read_table(path, KEY) is None
    assert "not used: not a tuning table" in caplog.text


def test_write_is_atomic_and_a_read_only_place_only_warns(tmp_path, caplog):
    t = table(ring=(1.0, 2.0, 3.0))
    path = tmp_path / "deep" / "t.json"
    assert write_table(path, t) and read_table(path, KEY) == t
    assert [p.name for p in path.parent.iterdir()] == ["t.json"]  # no temporary left behind
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger="collectives"):
        assert not write_table(blocked / "t.json", t)
    assert "not written" in caplog.text


def test_the_cache_lives_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv("HPCTK_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == str(tmp_path / "c" / "allreduce")
    monkeypatch.delenv("HPCTK_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == str(tmp_path / "x" / "hpc-toolkit" / "allreduce")


def test_huge_pages_make_another_host_type(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    with_them = host_type()
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert with_them != host_type() and with_them.endswith(" thp")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "true")  # torch warns and leaves huge pages off
    assert not host_type().endswith(" thp")
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert not host_type().endswith(" thp")
