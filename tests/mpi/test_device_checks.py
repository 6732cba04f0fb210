"""The device suite's CPU plumbing mode (`python -m benchmarks.device --mode cpu`), so the command
prepared for the lent GPU machine cannot rot between lendings: every check runs on tiny sizes,
the throughput checks in 2 interleaved rounds with every pair's ratios, spread and targets in the
report, the resume check must be bit-exact, a check over its budget is killed without losing the
others, and a signalled command still leaves its summary."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.runs import ROOT

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def device_suite(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.device", "--mode", "cpu", *args]


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


# Every check but `resume` (suite time: 70 s here): its stop, resume and comparison are the
# `handle` check's own (stop_resume_and_compare), and the two tests below start it; and but
# `allreduce` (25-30 s): its launches are `python -m collectives.bench --np N`, which
# tests/mpi/test_mpi_ranks.py runs the same way.
# And but `compile` (35 s: torch.compile of two models on 2 cores), which only the device runs.
# And but `scaling` (35-60 s: four launches of benchmarks/plain_loop.py, a benchmark's own loop
# that no issue's figure waits on): its table is tests/unit/test_device_summary.py's.
# And but `lm` (a toolkit launch and its reference, 15-20 s): the pair machinery is resnet50's and
# nanogpt's here, and the lm task's exact resume is tests/mpi/test_verify.py's lm cell.
CPU_CHECKS = "environment,memory,resnet50,nanogpt,handle,loader,unit"
# Issue 43's pairs (check: its rounds here, pair -> the ratio's target), the toolkit against its
# reference. Each round costs a toolkit launch (8-15 s on 2 cores): one each, which runs every
# pair's own code; tests/unit/test_device_summary.py checks the rounds' order, median,
# spread and targets over more rounds.
PAIRS = {
    "resnet50": (1, {"resnet50": 0.98}),
    "nanogpt": (1, {"nanogpt": 0.99}),
}
ROUNDS = ["--rounds", "1", *(arg for check, (rounds, _) in PAIRS.items() if rounds > 1 for arg in ("--rounds", f"{check}={rounds}"))]
SPEED_TARGETS = (": toolkit / reference, median of the rounds", ": toolkit's step time waiting for data, median")  # 2 cores: may be missed


def toolkit_records(scratch: Path, check: str, name: str, index: int) -> dict:
    """What the toolkit's run of round `index` left: its last epoch record (metrics.jsonl), or the
    script's own result (nanogpt)."""
    if check == "nanogpt":
        return json.loads((scratch / check / f"handle-{index}" / "result.json").read_text())
    (metrics,) = (scratch / check / f"{name.replace(', ', '-')}-{index}" / "runs").glob("*/*/metrics.jsonl")
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "data_wait_ms" in r][-1]


def assert_pair_reported(check: dict, name: str, rounds: int, target: float, markdown: str, files: dict[int, dict]) -> None:
    """`rounds` rounds, the toolkit first in the first, the reference in the second; the ratio of
    each, their median and spread, and the targets, consistent with the rates measured and with
    the toolkit's own records (`files`: round -> toolkit_records)."""
    entry = check["pairs"][name]
    rows = entry["rows"]
    assert entry["rounds"] == entry["rounds_asked"] == rounds and [r["first"] for r in rows] == ["toolkit", "reference"][:rounds], entry
    ratios = [r["toolkit"] / r["reference"] for r in rows]
    assert all(r["toolkit"] > 0 and r["reference"] > 0 for r in rows) and [r["ratio"] for r in rows] == ratios
    assert entry["ratio"] == {"median": sum(ratios) / rounds, "min": min(ratios), "max": max(ratios)}  # 1 or 2 rounds: the median is the mean
    median = entry["ratio"]["median"]
    targets = check["targets"]
    assert targets[f"{name}: toolkit / reference, median of the rounds"] == {"value": median, "target": f">= {target}", "met": median >= target}
    assert targets[f"{name}: rounds finished"] == {"value": rounds, "target": f">= {rounds}", "met": True}
    assert entry["toolkit_does"] and entry["reference_does"]  # what each side does, in words
    waited = targets.get(f"{name}: toolkit's step time waiting for data, median")
    if name == "nanogpt":  # a user's script: the handle does not see its data
        assert waited is None and "data_wait" not in entry
        assert [r["toolkit"] for r in rows] == [files[i]["tokens_per_s"] for i in range(1, rounds + 1)] and files[1]["handle"] is True
    else:  # the toolkit run's metrics.jsonl: data_wait_ms / step_ms (and, for images, its 2nd epoch's img/s)
        shares = [r["data_wait_share"] for r in rows]
        assert shares == [files[i]["data_wait_ms"] / files[i]["step_ms"] for i in range(1, rounds + 1)]
        assert all(0 <= w < 1 for w in shares) and waited == {"value": sum(shares) / rounds, "target": "< 2%", "met": waited["value"] < 0.02}
        if name.startswith("resnet50"):
            assert [r["toolkit"] for r in rows] == [files[i]["samples_per_s"] for i in range(1, rounds + 1)] and files[1]["epoch"] == 2
    if name.startswith("resnet50"):  # issue 43's first bar beside the honest reference
        assert set(entry["others"]["toolkit / raw loop, batch already on the device"]) == {"median", "min", "max"}
        (steady,) = (spread for key, spread in entry["others"].items() if key.startswith("toolkit, steady state (step times after the epoch's first "))
        assert 0 < steady["min"] <= steady["median"] <= steady["max"]
    assert f"| {name} | {rounds} of {rounds} | " in markdown and f"**{median:.3f}x** | {min(ratios):.3f}..{max(ratios):.3f} | >= {target} |" in markdown


def test_cpu_mode_runs_every_check_and_the_resume_is_bit_exact(tmp_path):
    done = subprocess.run(
        device_suite("--out", str(tmp_path / "out"), "--scratch", str(tmp_path / "scratch"), "--deadline-s", "900", "--only", CPU_CHECKS, *ROUNDS),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=1000,
    )  # 100-140 s in the suite beside the other worker (CI, 2 cores)
    tmp_path = tmp_path / "out"
    checks = summary(tmp_path)["checks"]
    failed = {name: c.get("error") for name, c in checks.items() if c["status"] not in ("ok", "missed a target", "skipped")}
    assert not failed, failed
    assert {name for name, c in checks.items() if c["status"] == "skipped"} == {"unit"}  # CI runs the unit tier itself
    # Speed is not asserted (a speed target may be missed on 2 cores); that every figure was measured is, and no other target is missed
    missed = [(name, target) for name, c in checks.items() for target, row in c.get("targets", {}).items() if not row["met"]]
    assert all(target.endswith(SPEED_TARGETS) for _, target in missed), missed
    assert list(checks) == ["setup", *CPU_CHECKS.split(",")]
    handle = checks["handle"]  # a user's script with the run handle: stopped and resumed bit for bit
    assert handle["status"] == "ok" and all(t["met"] for t in handle["targets"].values()), handle
    assert 0 < handle["figures"]["stopped by SIGUSR1 after step"] < handle["figures"]["uninterrupted steps"] == handle["figures"]["steps compared"]
    markdown = (tmp_path / "summary.md").read_text()
    for check, (rounds, pairs) in PAIRS.items():
        assert set(checks[check]["pairs"]) == set(pairs)
        for name, target in pairs.items():
            files = {i: toolkit_records(tmp_path.parent / "scratch", check, name, i) for i in range(1, rounds + 1)}
            assert_pair_reported(checks[check], name, rounds, target, markdown, files)
    for check in PAIRS:  # the driver prints each check's time as it ends, and a recap last (a device call returns the output's tail)
        assert re.search(rf"^\[ *\d+ s\] {check}: .+, \d+ s of its \d+ s budget$", done.stdout, re.M), done.stdout
    recap = done.stdout.rpartition("Recap")[2]
    assert "| resnet50 | 1 of 1 | " in recap and "\nhandle: ok, " in recap, recap
    memory = checks["memory"]["figures"]  # replicated and FSDP2 (world size one) train alike
    assert memory["replicated: losses of 3 steps"] == memory["fsdp2: losses of 3 steps"] and memory["fsdp2: parameters"] > 0
    raw_rate = checks["resnet50"]["pairs"]["resnet50"]["reference_median"]  # the loader's rate is set against the GPU step's
    assert checks["loader"]["figures"]["GPU step's consumption (resnet50 raw loop), img/s"] == raw_rate
    assert all(f"## {name}: " in markdown for name in checks)
    assert "===== handle: ok" in (tmp_path / "logs.txt").read_text()
    assert done.returncode == (0 if all(c["status"] in ("ok", "skipped") for c in checks.values()) else 1)


def test_a_check_over_its_budget_is_killed_with_its_processes_and_the_next_still_runs(tmp_path):
    done = subprocess.run(
        device_suite("--out", str(tmp_path), "--scratch", str(tmp_path / "scratch"), "--only", "resume,environment", "--budget", "resume=4"),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    checks = summary(tmp_path)["checks"]
    assert checks["resume"]["status"] == "timed out" and "over its budget of 4 s" in checks["resume"]["error"]
    assert checks["environment"]["status"] == "ok" and checks["environment"]["figures"]["torch"]
    assert done.returncode == 1
    # The killed check's launch.py, mpirun and ranks went with it (one process group)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert left == [], left


def test_a_signalled_command_reports_what_finished_and_names_the_running_check(tmp_path):
    proc = subprocess.Popen(
        device_suite("--out", str(tmp_path), "--only", "environment,resume"), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / "summary.json").exists() or summary(tmp_path)["checks"]["resume"]["status"] != "running":
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        assert time.monotonic() < deadline, "the resume check never started"
        time.sleep(0.05)  # polling the summary file: there is no event to wait on
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 1
    checks = summary(tmp_path)["checks"]
    assert checks["environment"]["status"] == "ok"
    assert checks["resume"]["status"] == "killed" and "SIGTERM" in checks["resume"]["error"]
    assert "## resume: killed" in (tmp_path / "summary.md").read_text()
