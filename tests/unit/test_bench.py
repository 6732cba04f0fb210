import argparse

import pytest

from collectives.bench import bus_bandwidth, crossover, human, parse_args, parse_size, render_markdown, sizes_between


@pytest.mark.parametrize("text, size", [("8", 8), ("64K", 65536), ("16M", 16 << 20), ("1G", 1 << 30), ("2kb", 2048)])
def test_sizes_parse_like_nccl_tests(text, size):
    assert parse_size(text) == size


def test_bad_size_is_an_argparse_error():
    with pytest.raises(argparse.ArgumentTypeError, match=r"not a size: 'LOTS' \(e.g. 8, 64K, 16M\)"):
        parse_size("lots")


def test_size_sweep_and_bad_sweeps():
    assert sizes_between(8, 128, 2) == [8, 16, 32, 64, 128]
    assert sizes_between(1024, 1024, 4) == [1024]
    for bad in ((0, 8, 2), (16, 8, 2), (8, 64, 1)):
        with pytest.raises(ValueError, match=r"need 1 <= -b <= -e and -f >= 2"):
            sizes_between(*bad)


def test_bus_bandwidth_matches_the_nccl_tests_formula():
    algbw, busbw = bus_bandwidth(1_000_000_000, 0.5, 4)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(2.0 * 2 * 3 / 4)
    assert bus_bandwidth(8, 1.0, 1)[1] == 0.0


def row(impl, size, time_us):
    return {"impl": impl, "bytes": size, "time_us": time_us, "algbw_gbs": 0.0, "busbw_gbs": 1.5, "max_error": 0.0}


def test_crossover_is_the_size_from_which_ring_always_wins():
    results = [
        row("ring", 1, 9),
        row("rhd", 1, 5),
        row("ring", 2, 4),
        row("rhd", 2, 5),
        row("ring", 4, 7),
        row("rhd", 4, 6),
        row("ring", 8, 1),
        row("rhd", 8, 9),
    ]
    assert crossover(results) == 8
    assert crossover([row("ring", 1, 9), row("rhd", 1, 5)]) is None


def test_markdown_table_has_a_row_per_size_and_a_column_per_implementation():
    meta = {"world_size": 2, "hosts": "h", "date": "d", "command": "c", "not_run": ["horovod"]}
    text = render_markdown([row("ring", 1024, 10.0), row("mpi", 1024, 12.0), row("ring", 2048, 11.0), row("mpi", 2048, 13.0)], meta)
    assert "| size | ring | mpi |" in text and "| 1 KiB | 1.50 (10) | 1.50 (12) |" in text and "not run: horovod" in text
    assert human(3 << 20) == "3 MiB" and human(100) == "100 B"


@pytest.mark.parametrize("argv", [["--algos", "ring,warp"], ["-n", "0"], ["-b", "64", "-e", "8"]])
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err
