"""What benchmarks/preemption_trials.py compares and reports, on run dirs written here (the runs
themselves need the simulated Slurm and minutes each: they are the benchmark, not a test)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.preemption_trials import STRETCHES, goodput, job_goodput, losses, markdown_row, weights_digest
from trainers.checkpoint.layout import MARKER, SHARED, step_dir_name
from trainers.checkpoint.tensorfile import write_tensor_file


def checkpoint(run_dir: Path, step: int, weight: float, committed: bool = True) -> None:
    folder = run_dir / "checkpoints" / step_dir_name(step)
    folder.mkdir(parents=True)
    write_tensor_file(folder / SHARED, {"model": {"w": torch.full((3,), weight), "b": torch.zeros(2)}})
    if committed:
        (folder / MARKER).touch()


def test_the_final_weights_are_those_of_the_newest_committed_checkpoint(tmp_path: Path):
    one, two = tmp_path / "one", tmp_path / "two"
    checkpoint(one, 10, 1.0)
    checkpoint(two, 10, 1.0)
    assert weights_digest(one) == weights_digest(two)
    checkpoint(two, 20, 2.0, committed=False)  # never committed: not the model
    assert weights_digest(one) == weights_digest(two)
    checkpoint(two, 30, 1.0 + 1e-7)
    assert weights_digest(one) != weights_digest(two)


def test_goodput_counts_each_step_s_last_run_over_the_wall_time(tmp_path: Path):
    rows = [{"step": 1, "step_ms": 1000.0, "loss": 2.0}, {"step": 2, "step_ms": 1000.0, "loss": 1.5}, {"step": 2, "step_ms": 3000.0, "loss": 1.25}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert goodput(tmp_path, 100.0, 110.0, 2.0) == 4.0 / 8.0  # step 2 counted once, as last run
    assert job_goodput(600.0, 812.0, 12.0) == 0.75  # the uninterrupted wall over this one's, hold and queue wait out
    assert losses(tmp_path) == {1: 2.0, 2: 1.25}


def test_a_run_becomes_one_markdown_row_that_says_what_failed():
    row = {
        "label": "every 60 s",
        "preemptions": 9,
        "completed": True,
        "identical_losses": True,
        "identical_weights": False,
        "max_redone_steps": 3,
        "median_s": {key: (None if key == "held_s" else 1.25) for key in STRETCHES},
        "goodput": 0.71234,
        "reference_goodput": 0.879,
        "goodput_beyond_hold": 0.7201,
        "job_goodput": 0.7501,
        "waited_s": 12.2,
        "wall_s": 812.4,
        "reference_wall_s": 600.2,
    }
    cells = [cell.strip() for cell in markdown_row(row).strip("|").split("|")]
    assert cells[:5] == ["every 60 s", "9", "yes", "NO", "3"]
    assert cells[5].split(" / ") == ["-" if key == "held_s" else "1.2" for key in STRETCHES]
    assert cells[6:] == ["0.712 (0.879)", "0.720", "**0.750**", "812 - 12 (600)"]


def test_the_spare_node_benchmark_splits_each_interruption_into_its_phases():
    """Detection is what rank 0's logged total (from the failure as detected) leaves of the kill
    -> first resumed step; each phase's median and range over the rounds, per path."""
    from benchmarks.spare_node import phase_table, phases

    cost = {"to_exit_s": 2.0, "relaunch_s": 1.0, "start_up_s": 4.0, "load_s": 0.5, "first_step_s": 0.5, "total_s": 8.0}
    rows = [{"path": "spare", "phases": phases(cost, to), "to_first_step_s": to} for to in (20.0, 21.0, 26.0)]
    assert rows[0]["phases"] == {"detection": 12.0, "drain": 2.0, "relaunch": 1.0, "start-up": 4.0, "load": 0.5, "first step": 0.5}
    spare_row = phase_table(rows)[2]
    assert spare_row.startswith("| spare | 3 | 13.0 (12.0-18.0) | 2.0 (2.0-2.0) |") and spare_row.endswith("| 21.0 (20.0-26.0) |")
