"""`python -m hpc.stop RUN_DIR`, as docs/checkpoints.md shows it, on a real local run of two
ranks: both ranks stop at the same step with a committed checkpoint, only the ranks were
signalled, and the run resumes from that step; its MLflow and W&B runs are one each, every step
logged once."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.rank.lifecycle import EXIT_RESUMABLE
from tests.support.docs import marked_blocks
from tests.support.runs import logged_steps, rank_pids, resume_command, start_launch, stopped_pattern, wait_for_run
from tests.support.trackers import one_tracker_run_each
from trainers.checkpoint.layout import committed_steps, rank_files, step_dir_name

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# Slow enough per step (a wide MLP) that the stop lands mid-run even on a loaded machine, short enough (4 epochs, 88
# steps) that the resumed run ends soon.
JOB = ["model.hidden_sizes=[512,512]", "trainer.epochs=4", "checkpoint.every_steps=7", "checkpoint.every_minutes=null"]


def documented_stop(run_dir: Path) -> list[str]:
    """The stop command of docs/checkpoints.md, for `run_dir`."""
    (block,) = marked_blocks("docs/checkpoints.md", __file__)
    (line,) = [line for line in block.body.splitlines() if line.strip()]
    words = shlex.split(line, comments=True)
    assert words[:3] == ["python", "-m", "hpc.stop"] and len(words) == 4, words
    return [sys.executable, "-m", "hpc.stop", str(run_dir)]


def documented_trackers(where: Path) -> tuple[dict[str, str], list[str]]:
    """The trackers' variables and the launch overrides of docs/observability.md, run in `where`."""
    (block,) = marked_blocks("docs/observability.md", __file__)
    export, launch = [line for line in block.body.splitlines() if line.strip()]
    words = shlex.split(export.replace("$PWD", str(where)))
    assert words[0] == "export", export
    variables = dict(word.split("=", 1) for word in words[1:])
    words = shlex.split(launch, comments=True)
    assert words[:2] == ["python", "launch.py"], launch
    return variables, words[2:]


def test_hpc_stop_stops_both_ranks_at_one_step_with_a_committed_checkpoint_and_the_run_resumes(tmp_path, monkeypatch):
    variables, overrides = documented_trackers(tmp_path)
    assert set(variables) == {"MLFLOW_TRACKING_URI", "WANDB_MODE"} and overrides == ["trackers=[mlflow,wandb]"]
    for name, value in {**variables, "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)  # the ranks read the trackers' own variables
    launched = start_launch(*JOB, *overrides, cwd=tmp_path)
    run_dir = wait_for_run(launched, tmp_path, lambda run: logged_steps(run) >= 3 and len(list((run / "heartbeats").glob("rank-*.json"))) == 2, "3 steps")
    ranks = sorted(rank_pids(run_dir))
    # command.txt typed while the run trains: refused, not a second set of ranks in its run dir
    command, env = resume_command(run_dir)
    twice = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    refusal = f"error: {run_dir} is running already; stop it first (python -m hpc.stop {run_dir}) or wait for its end\n"
    assert twice.returncode == 2 and twice.stderr == refusal, twice.stderr
    stop = subprocess.run(documented_stop(run_dir), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr
    sent = rf"sent SIGUSR1 to 2 ranks of {re.escape(str(run_dir))} \(pids (\d+), (\d+)\)"
    said = re.fullmatch(sent + r": they stop at the same step and save; bash \S+ resumes\n", stop.stdout)
    assert said is not None, stop.stdout + stop.stderr
    assert sorted(map(int, said.groups())) == ranks  # the ranks themselves: not mpirun, not the launcher
    assert launched.wait(timeout=120) == EXIT_RESUMABLE, launched.stderr.read() if launched.stderr else ""

    result = json.loads((run_dir / "result.json").read_text())
    stopped = result["steps"]
    assert result["status"] == "stopped" and 3 <= stopped < 88
    assert max(committed_steps(run_dir / "checkpoints")) == stopped  # every rank saved that very step, committed
    assert len(rank_files(run_dir / "checkpoints" / step_dir_name(stopped))) == 2
    assert re.search(stopped_pattern("SIGUSR1", stopped), (run_dir / "logs" / "rank-00000.log").read_text())

    again = subprocess.run(documented_stop(run_dir), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stdout == "" and len(again.stderr.splitlines()) == 1
    assert f"error: {run_dir} is not running (it stopped)" in again.stderr

    command, env = resume_command(run_dir)
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["resumed_from"], result["steps"]) == ("completed", stopped, 88)
    one_tracker_run_each(tmp_path, run_dir, steps=88, starts=2)
