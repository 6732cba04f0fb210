import argparse
from pathlib import Path

import pytest

from collectives.bench import launch_argv, parse_args, parse_size, rotated, sizes_between
from collectives.bench_report import bound_busbw, bus_bandwidth, crossover, human, median_interval, render_markdown, summarize, verdict


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


def launch(impl, round_, times, memory=None):
    sizes = (1 << 20, 4 << 20)
    record = {"impl": impl, "round": round_, "results": [{"bytes": n, "time_us": t, "max_error": 0.0} for n, t in zip(sizes, times, strict=True)]}
    if memory:
        record["memory"] = [{"bytes": n, "copy_gbs": c, "add_gbs": a} for n, (c, a) in zip(sizes, memory, strict=True)]
    return record


def test_the_bound_is_what_reading_peers_in_place_allows():
    assert bound_busbw(10.0, 10.0) == pytest.approx(10.0)
    assert bound_busbw(12.0, 6.0) == pytest.approx(8.0)  # 2 / (1/6 + 1/12)
    assert bound_busbw(0.0, 5.0) == 0.0


def test_summary_takes_medians_over_rounds_and_pairs_ratios_by_round():
    launches = [
        launch("auto", 0, (100, 400), memory=((10, 10), (8, 8))),
        launch("mpi", 0, (150, 400)),
        launch("auto", 1, (200, 500)),
        launch("mpi", 1, (200, 1000), memory=((10, 10), (4, 4))),
        launch("auto", 2, (120, 410)),
        launch("mpi", 2, (110, 410)),
    ]
    summary = summarize(launches, world=2)
    rows = {(r["impl"], r["bytes"]): r for r in summary["rows"]}
    assert rows["auto", 1 << 20]["time_us"] == 120 and rows["mpi", 1 << 20]["time_us"] == 150
    assert rows["mpi", 4 << 20]["time_us_max"] == 1000 and rows["mpi", 4 << 20]["rounds"] == 3
    bound = summary["bound"]
    assert bound[1 << 20]["bound_busbw_gbs"] == pytest.approx(10.0) and bound[4 << 20]["copy_gbs"] == pytest.approx(6.0)
    auto_1m = rows["auto", 1 << 20]
    assert auto_1m["of_bound"] == pytest.approx(auto_1m["busbw_gbs"] / 10.0)
    ratio = next(r for r in summary["auto_ratios"] if r["vs"] == "mpi" and r["bytes"] == 1 << 20)
    assert ratio["median"] == pytest.approx(1.0) and ratio["min"] == pytest.approx(110 / 120) and ratio["max"] == pytest.approx(1.5)


def test_markdown_has_a_row_per_size_the_bound_and_autos_ratios():
    launches = [launch("auto", 0, (100, 400), memory=((10, 10), (8, 8))), launch("mpi", 0, (150, 400)), launch("gloo", 0, (300, 900))]
    meta = {
        "world_size": 2,
        "hosts": "h",
        "cpu_count": 2,
        "date": "d",
        "command": "c",
        "rounds": 1,
        "layout": "one launch per implementation",
        "not_run": ["horovod"],
    }
    text = render_markdown(summarize(launches, 2), meta)
    assert "| size | auto | mpi | gloo | bound (copy, add) |" in text
    assert "| 1 MiB | 10.49 (1.05) | 6.99 (0.70) | 3.50 (0.35) | 10.0 (10.0, 10.0) |" in text
    assert "| 1 MiB | 1.50 [1.50-1.50] | 3.00 [3.00-3.00] |" in text and "not run: horovod" in text
    assert "Too few rounds to call auto faster or slower" in text  # one round is no evidence
    assert human(3 << 20) == "3 MiB" and human(100) == "100 B"


def test_rounds_rotate_so_no_implementation_always_runs_first():
    names = ["ring", "mpi", "horovod"]
    assert [rotated(names, r)[0] for r in range(4)] == ["ring", "mpi", "horovod", "ring"]
    assert sorted(rotated(names, 2)) == sorted(names)


def test_each_launch_runs_one_implementation_with_the_same_sizes():
    args = parse_args(["--np", "4", "--ranks-per-node", "2", "-b", "1M", "-e", "4M", "--tuning-cache", "/t"])
    argv = launch_argv(args, "hierarchical", 2, Path("/r.json"))
    again = parse_args(argv)
    assert again.algos == ["hierarchical"] and again.np_ is None and again.rounds == 1 and again.first_round == 2
    assert (again.begin, again.end, again.ranks_per_node, again.tuning_cache) == (1 << 20, 4 << 20, 2, "/t")


@pytest.mark.parametrize(
    "argv", [["--algos", "ring,warp"], ["-n", "0"], ["-b", "64", "-e", "8"], ["--rounds", "0"], ["--np", "3", "--ranks-per-node", "2"], ["--np", "0"]]
)
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("n", "rank", "coverage"),
    [(1, 1, 0.0), (4, 1, 0.875), (5, 1, 1 - 2 / 32), (8, 1, 1 - 2 / 256), (9, 2, 1 - 2 * 10 / 512), (17, 5, 1 - 2 * (1 + 17 + 136 + 680 + 2380) / 2**17)],
)
def test_the_median_interval_is_the_sign_tests_order_statistics(n, rank, coverage):
    values = [float(v) for v in range(n, 0, -1)]  # unsorted on purpose
    low, high, covered = median_interval(values)
    assert (low, high) == (rank, n + 1 - rank)
    assert covered == pytest.approx(coverage) and (covered >= 0.95 or rank == 1)
    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_a_cell_is_called_only_when_its_whole_interval_is_on_one_side():
    assert verdict(1.02, 1.3, 0.96) == "faster" and verdict(0.7, 0.98, 0.96) == "slower"
    assert verdict(0.9, 1.1, 0.96) == "par" and verdict(1.0, 1.2, 0.96) == "par"
    assert verdict(1.5, 1.6, 0.75) == "unknown"  # 3 rounds: min-max holds the median 75% of the time


def test_autos_verdicts_over_nine_rounds():
    # auto: 100 us in every round; mpi is slower in 8 of 9 rounds, ring faster in 8 of 9, rhd both ways.
    ring = [90, 95, 92, 97, 91, 93, 96, 94, 130]
    mpi = [120, 110, 130, 125, 115, 140, 118, 112, 80]
    rhd = [90, 110, 95, 105, 98, 102, 99, 101, 100]
    launches = [launch("auto", r, (100, 100)) for r in range(9)]
    for name, times in (("ring", ring), ("mpi", mpi), ("rhd", rhd)):
        launches += [launch(name, r, (t, t)) for r, t in enumerate(times)]
    summary = summarize(launches, 2)
    verdicts = {r["vs"]: r["verdict"] for r in summary["auto_ratios"] if r["bytes"] == 1 << 20}
    assert verdicts == {"ring": "slower", "mpi": "faster", "rhd": "par"}
    meta = {"world_size": 2, "hosts": "h", "cpu_count": 2, "date": "d", "command": "c", "rounds": 9, "layout": "l", "not_run": []}
    text = render_markdown(summary, meta)
    assert "holds the median with 96% confidence" in text
    assert "than: ring at 1 MiB, ring at 4 MiB; faster (marked +) in 2 of 6 cells" in text
    assert "| 1 MiB | 0.94 [0.91-0.97] - | 1.00 [0.95-1.05] | 1.18 [1.10-1.30] + |" in text
