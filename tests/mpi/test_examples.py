"""Every project under examples/ runs the command its README gives, as written (CI runs them)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from hpc.rundir import RunDir
from hpc.tools.status import run_status
from tests.support.runs import ROOT, run_dirs

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]
EXAMPLES = sorted(p.parent for p in (ROOT / "examples").glob("*/README.md"))


def readme_command(example_dir):  # type: ignore[no-untyped-def]
    text = (example_dir / "README.md").read_text()
    block = text[text.index("```bash\n") + len("```bash\n") : text.index("```", text.index("```bash\n") + 8)]
    (line,) = [line for line in block.splitlines() if line.strip()]
    return shlex.split(line)


def test_there_are_the_example_projects():
    assert [p.name for p in EXAMPLES] == ["char_gpt", "gan_ema", "hf_trainer", "lightning", "own_loop", "regression"]


def check_regression(example, run_dir, stdout):  # type: ignore[no-untyped-def]
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert "within_3_sigma" in steps[-1] and epochs[-1]["val_within_3_sigma"] > 0.9 and epochs[-1]["val_loss"] < 0.01
    assert (run_dir / "code" / "linefit" / "tasks.py").read_text() == (example / "linefit" / "tasks.py").read_text()


def check_own_loop(example, run_dir, stdout):  # type: ignore[no-untyped-def]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 201)) and steps[-1]["loss"] < steps[0]["loss"] / 2
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["steps"], result["world_size"]) == ("completed", 200, 2) and result["val_metrics"]["loss"] < 0.2
    assert (run_dir / "checkpoints" / "step-000000200" / "COMMITTED").is_file() and "trained 200 steps" in stdout


def check_char_gpt(example, run_dir, stdout):  # type: ignore[no-untyped-def]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluations, (memory,) = records[:-1], records[-1:]  # run.finish() adds each rank's peak memory
    assert len(memory["peak_memory_mib"]) == 2 and all(peak > 50 for peak in memory["peak_memory_mib"])  # torch alone takes more
    assert [e["step"] for e in evaluations] == [20, 40] and evaluations[-1]["val_loss"] < 4.0  # a byte model starts at ln 256 = 5.5
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["steps"]) == ("completed", 40) and result["val_metrics"] == {"loss": evaluations[-1]["val_loss"]}
    assert "best val loss" in stdout


def check_gan_ema(example, run_dir, stdout):  # type: ignore[no-untyped-def]
    evaluations = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][:-1]  # the last: peak memory
    assert [e["step"] for e in evaluations] == [250, 500, 750, 1000]
    result = json.loads((run_dir / "result.json").read_text())
    last = evaluations[-1]
    assert (result["status"], result["steps"]) == ("completed", 1000) and result["val_metrics"] == {"w1": last["val_w1"], "w1_ema": last["val_w1_ema"]}
    assert last["val_w1_ema"] < 0.4  # the two modes are 4 apart: a generator that found one only is 2 away
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert {"d_loss", "g_loss"} <= set(steps[-1]) and "trained 1000 steps" in stdout
    shared = run_dir / "checkpoints" / "step-000001000"
    assert (shared / "COMMITTED").is_file()


def check_lightning(example, sweep_dir, stdout):  # type: ignore[no-untyped-def]
    """An Optuna study over hpc.lightning's script: each trial's val_acc read from its result.json."""
    trials = sorted(p.parent for p in sweep_dir.glob("*/result.json"))
    results = [json.loads((trial / "result.json").read_text()) for trial in trials]
    assert len(results) == 3 and all(r["status"] == "completed" and r["steps"] == 40 for r in results), results
    told = [float(line.split("val_acc=")[1]) for line in stdout.splitlines() if line.startswith("trial #") and "val_acc=" in line]  # 6 digits
    assert sorted(told) == sorted(round(r["val_metrics"]["acc"], 6) for r in results) and "best of 3 completed trials" in stdout, stdout[-2000:]
    rates = {(trial / "config.yaml").read_text().split("--lr")[1].split()[1] for trial in trials}
    assert len(rates) == 3  # each trial's own learning rate reached its script


def check_hf_trainer(example, run_dir, stdout):  # type: ignore[no-untyped-def]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps[-1]["step"] == 100 and steps[-1]["loss"] < 0.6 * steps[0]["loss"]  # ln 64 = 4.2 at the start
    evaluations = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_acc" in line]
    assert [e["step"] for e in evaluations] == [50, 100] and evaluations[-1]["val_acc"] > evaluations[0]["val_acc"]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["steps"], result["world_size"]) == ("completed", 100, 2)
    assert result["val_metrics"]["acc"] == evaluations[-1]["val_acc"]
    status = run_status(RunDir(run_dir), {})  # hpc.status's line: the step, the rate and the figures logged
    assert (status.state, status.last_step) == ("COMPLETED", 100) and status.rate.endswith("steps/s"), status
    assert f"val_acc={result['val_metrics']['acc']:.4g}" in status.metrics, status.metrics


CHECKS = {
    "regression": check_regression,
    "own_loop": check_own_loop,
    "char_gpt": check_char_gpt,
    "gan_ema": check_gan_ema,
    "lightning": check_lightning,
    "hf_trainer": check_hf_trainer,
}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_example_runs_as_its_readme_says(example, tmp_path):
    words = readme_command(example)
    env = dict(os.environ)
    if words[0] == "PYTHONPATH=$PWD":
        env["PYTHONPATH"], words = str(example), words[1:]
    assert words[0] == "python"
    command = [sys.executable, *words[1:]]
    at = command.index("--") if "--" in command else len(command)  # launch.py's overrides come before a script's arguments
    command.insert(at, f"run_root={tmp_path / 'runs'}")
    done = subprocess.run(command, cwd=example, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path) if "-m" not in words else (tmp_path / "runs" / "sweeps").glob("*/*")  # a sweep: its dir
    CHECKS[example.name](example, run_dir, done.stdout)
