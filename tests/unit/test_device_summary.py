"""The device suite's summary (benchmarks/device/summary.py), its interleaved rounds
(benchmarks/device/rounds.py), its budgets and rounds options; the local launcher's rendezvous
for command.txt (hpc.launching.ranks.rendezvous)."""

from __future__ import annotations

import json
import socket

import pytest

from benchmarks.device.__main__ import BUDGET_S, CPU_BUDGET_S, CPU_ROUND_S, ROUND_CHECKS, ROUND_S, parse_budgets, parse_rounds, round_budgets
from benchmarks.device.report import BUDGET_VARIABLE, Report
from benchmarks.device.rounds import Measured, Pair, interleave
from benchmarks.device.summary import render_markdown
from hpc.env import PORT_BASE
from hpc.launching.ranks import ephemeral_ports, free_port, with_local_rendezvous


def test_the_summary_shows_every_check_its_targets_figures_tables_and_errors():
    summary = {
        "mode": "gpu",
        "started": "2026-11-26T04:00:00+00:00",
        "host": "gpu-1",
        "cores": 16,
        "command": "python3 -m benchmarks.device --out /out",
        "checks": {
            "resnet50": {
                "status": "missed a target",
                "seconds": 80.2,
                "budget_s": 120,
                "targets": {"trainer / raw loop": {"value": 0.9512, "target": ">= 0.97", "met": False}},
                "figures": {"raw loop, batch on the device, img/s": 4007.3},
                "tables": ["| a | b |\n| --- | --- |\n| 1 | 2 |"],
            },
            "lm": {"status": "timed out", "seconds": 75.0, "budget_s": 75, "error": "timed out after 75 s"},
            "unit": {"status": "not run"},
        },
    }
    text = render_markdown(summary)
    assert "| resnet50 | missed a target | 80.2 |" in text and "| unit | not run |  |" in text
    assert "| trainer / raw loop | 0.951 | >= 0.97 | NO |" in text
    assert "| raw loop, batch on the device, img/s | 4,007 |" in text
    assert "| 1 | 2 |" in text and "## lm: timed out, 75 s of 75" in text and "error: timed out after 75 s" in text


def test_budgets_are_overridden_by_name_and_bad_ones_refused():
    assert parse_budgets(["lm=5", "resume=2.5"], BUDGET_S)["lm"] == 5 and parse_budgets([], CPU_BUDGET_S) == CPU_BUDGET_S
    for bad in ("lm", "nope=3", "lm=-1", "lm=x"):
        with pytest.raises(SystemExit, match="--budget"):
            parse_budgets([bad], BUDGET_S)
    assert set(BUDGET_S) == set(CPU_BUDGET_S)


def test_command_txt_gets_a_free_rendezvous_port_at_every_start():
    chosen = with_local_rendezvous({"PATH": "/bin"})
    assert chosen["MASTER_ADDR"] == "127.0.0.1" and 0 < int(chosen["MASTER_PORT"]) < 65536 and chosen["PATH"] == "/bin"
    inherited = with_local_rendezvous({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})  # a torchrun's, maybe held by another run
    assert inherited["MASTER_ADDR"] == "127.0.0.1" and inherited["MASTER_PORT"] != "29500"


def test_the_rendezvous_port_is_drawn_below_the_ephemeral_range_and_free_now(tmp_path):
    """mpirun's own listener binds an ephemeral port: it once took the one chosen here."""
    low, _ = ephemeral_ports()
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_ports(tmp_path / "range") == (40000, 50000) and ephemeral_ports(tmp_path / "none") == (32768, 60999)
    for _ in range(20):
        assert PORT_BASE <= int(with_local_rendezvous({})["MASTER_PORT"]) < low
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        held.listen()
        drawn = iter([taken, taken, PORT_BASE + 7])
        assert free_port(lambda ports: next(drawn)) == PORT_BASE + 7  # a port in use is drawn again


def fake_pair(name: str, toolkit: list[float], reference: list[float], calls: list[str], waits: list[float | None] | None = None) -> Pair:
    """A pair whose sides return the given rates round by round and note the order they ran in."""

    def side(which: str, rates: list[float]):
        def run(index: int) -> Measured:
            calls.append(f"{name} {which} {index + 1}")
            wait = waits[index] if which == "toolkit" and waits is not None else None
            if which == "reference":
                return Measured(rates[index], wait, others={"a bar": 2 * reference[index]})
            return Measured(rates[index], wait, variants={"steady": rates[index] + 1})

        return run

    return Pair(name, "img/s", 0.98, "what the toolkit does", "what the reference does", side("toolkit", toolkit), side("reference", reference))


def test_rounds_alternate_which_side_goes_first_and_report_the_median_ratio_its_spread_and_the_targets(tmp_path):
    calls: list[str] = []
    fast = fake_pair("fast", [99.0, 97.0, 101.0], [100.0] * 3, calls, [0.01, 0.03, 0.015])
    slow = fake_pair("slow", [90.0, 80.0, 85.0], [100.0] * 3, calls)
    report = Report(tmp_path / "check.json")
    interleave([fast, slow], 3, report)
    assert calls == [
        *("fast toolkit 1", "fast reference 1", "slow toolkit 1", "slow reference 1"),
        *("fast reference 2", "fast toolkit 2", "slow reference 2", "slow toolkit 2"),
        *("fast toolkit 3", "fast reference 3", "slow toolkit 3", "slow reference 3"),
    ]
    saved = json.loads((tmp_path / "check.json").read_text())  # what the driver reads
    entry = saved["pairs"]["fast"]
    assert [r["first"] for r in entry["rows"]] == ["toolkit", "reference", "toolkit"]
    assert entry["ratio"] == {"median": 0.99, "min": 0.97, "max": 1.01} and entry["met"] is True and entry["target"] == ">= 0.98"
    assert entry["others"]["toolkit / a bar"] == {"median": 0.495, "min": 0.485, "max": 0.505}
    assert entry["others"]["toolkit, steady / reference"] == {"median": 1.0, "min": 0.98, "max": 1.02}
    assert entry["data_wait"] == {"median": 0.015, "min": 0.01, "max": 0.03, "target": "< 2%", "met": True}
    assert entry["rounds"] == entry["rounds_asked"] == 3
    assert saved["pairs"]["slow"]["ratio"] == {"median": 0.85, "min": 0.8, "max": 0.9} and saved["pairs"]["slow"]["met"] is False
    assert "data_wait" not in saved["pairs"]["slow"]  # a side that reports no data wait (a script) has none
    targets = saved["targets"]
    assert targets["fast: toolkit / reference, median of the rounds"] == {"value": 0.99, "target": ">= 0.98", "met": True}
    assert targets["slow: toolkit / reference, median of the rounds"]["met"] is False
    assert targets["fast: toolkit's step time waiting for data, median"]["met"] is True
    assert targets["fast: rounds finished"] == {"value": 3, "target": ">= 3", "met": True}
    text = render_markdown({"mode": "gpu", "checks": {"resnet50": {"status": "missed a target", **saved}}})
    assert "| fast | 3 of 3 | 99 img/s | 100 img/s | **0.990x** | 0.970..1.010 | >= 0.98 | yes | 1.50% (max 3.00%) | < 2% | yes |" in text
    assert "| slow | 3 of 3 | 85 img/s | 100 img/s | **0.850x** | 0.800..0.900 | >= 0.98 | NO | n/a |  |  |" in text
    assert "- toolkit: what the toolkit does" in text and "- toolkit / a bar: 0.495x (0.485..0.505)" in text
    assert "| 2 | reference | 97 | 100 | 0.970 | 3.00% |" in text


def test_a_round_the_checks_budget_cannot_hold_is_not_started_and_the_rounds_finished_say_so(tmp_path, monkeypatch):
    monkeypatch.setenv(BUDGET_VARIABLE, "0.5")
    calls: list[str] = []
    pair = fake_pair("p", [1.0] * 5, [1.0] * 5, calls)
    slow = pair.run_toolkit

    def toolkit(index: int) -> Measured:
        import time

        time.sleep(0.3)  # the round takes 0.3 s; after it 0.2 s or less of the 0.5 s are left
        return slow(index)

    pair.run_toolkit = toolkit
    report = Report(tmp_path / "check.json")
    interleave([pair], 5, report)
    assert calls == ["p toolkit 1", "p reference 1"]
    assert report.data["targets"]["p: rounds finished"] == {"value": 1, "target": ">= 5", "met": False}
    assert report.data["pairs"]["p"]["rounds"] == 1 and "1 of 5 rounds" in report.data["notes"][0]


def test_rounds_are_set_for_every_throughput_check_or_one_and_their_budgets_grow_with_them():
    assert parse_rounds([]) == dict.fromkeys(ROUND_CHECKS, 1)
    assert parse_rounds(["5", "compile=2"]) == {"resnet50": 5, "lm": 5, "nanogpt": 5, "compile": 2}
    for bad in ("0", "x", "nope=2", "lm=0", "lm="):
        with pytest.raises(SystemExit, match="--rounds"):
            parse_rounds([bad])
    grown = round_budgets(BUDGET_S, ROUND_S, parse_rounds(["5", "compile=2"]))
    assert grown["resnet50"] == BUDGET_S["resnet50"] + 4 * ROUND_S["resnet50"] and grown["compile"] == BUDGET_S["compile"] + ROUND_S["compile"]
    assert grown["resume"] == BUDGET_S["resume"]  # not a throughput check
    from benchmarks.device.checks import ROUND_CHECKS as CHECKED  # the checks' own list, which the driver cannot import (torch)

    assert set(CHECKED) == set(ROUND_CHECKS) == set(ROUND_S) == set(CPU_ROUND_S) and set(ROUND_CHECKS) <= set(BUDGET_S)


def test_the_scaling_check_reports_each_variants_rate_and_efficiency_against_n_times_one_rank(tmp_path, monkeypatch):
    """The scaling check's table from plain_loop's launches (their rates given here: the launches
    are the benchmark's own, and a CPU run of them cost the suite a minute for no figure)."""
    from benchmarks import plain_loop
    from benchmarks.device import cores

    rates = {("single", 1): 100.0, ("nocomm", 2): 180.0, ("ours", 2): 160.0, ("ddp", 2): 120.0}
    asked: list[tuple[str, int, int]] = []

    def launch(name, args, scratch, round_):  # type: ignore[no-untyped-def]
        asked.append((name, plain_loop.variant_ranks(name, args.ranks), args.steps))
        return {"samples_s": rates[(name, plain_loop.variant_ranks(name, args.ranks))]}

    monkeypatch.setattr(plain_loop, "launch", launch)
    report = Report(tmp_path / "scaling.json")
    cores.scaling("cpu", tmp_path / "scratch", report)
    assert asked == [("single", 1, 3), ("nocomm", 2, 3), ("ours", 2, 3), ("ddp", 2, 3)]
    assert report.data["figures"]["1 rank, samples/s"] == 100.0
    (table,) = report.data["tables"]
    assert "| 2 | 180 (0.90) | 160 (0.80) | 120 (0.60) | 1.33x | 0.89 |" in table
