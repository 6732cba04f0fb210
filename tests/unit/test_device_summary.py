"""The device suite's summary (benchmarks/device/summary.py) and its budgets; the local launcher's
rendezvous for command.txt (hpc.submit.ranks.rendezvous)."""

from __future__ import annotations

import pytest

from benchmarks.device.__main__ import BUDGET_S, CPU_BUDGET_S, parse_budgets
from benchmarks.device.summary import render_markdown
from hpc.submit.ranks import with_local_rendezvous


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
