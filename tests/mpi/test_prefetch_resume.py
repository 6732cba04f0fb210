"""The handle's rule for exact resume, tested as the docs state it: a loop shaped like nanoGPT's
(each micro-step's batch drawn ahead, during the micro-step before it; dropout; gradient
accumulation; DDP on two ranks) that numbers its batches (`RandomWindows.batch(i)`) is stopped
twice at random steps and resumed under launch.py, once under torchrun, and ends with the
per-step losses and final weights of an uninterrupted run, bit for bit. (On the simulated Slurm:
tests/e2e/test_user_script_slurm.py.)"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.rundir import RunDir
from hpc.tools.status import run_status
from tests.support.runs import ROOT, ranks_environment, resume_command, run_dirs, step_losses
from trainers.checkpoint.export import export
from trainers.checkpoint.export import load as load_safetensors

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "prefetch" / "train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
ITERS = 24


def two_stops() -> tuple[int, int]:
    """Two signal steps: the first stop lands a step after its signal, so the second signal comes
    at least two steps later to fall in the resumed run; both before the last step."""
    first = random.randint(1, ITERS - 6)
    return first, random.randint(first + 2, ITERS - 3)


def weights(path: Path) -> list[list[float]]:
    return json.loads(path.read_text())["weights"]


def test_a_loop_that_draws_ahead_resumes_bit_exactly_after_two_stops_under_launch_py_and_torchrun(tmp_path):
    env = ranks_environment()
    reference = subprocess.run([*TORCHRUN, "--run-dir", "ref", "--out", "ref.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]
    expected = step_losses(tmp_path / "ref")
    assert len(expected) == ITERS

    stops = two_stops()
    said = f"stops after steps {stops}"
    # Under torchrun one stop (the second stop of a resumed run is launch.py's below, and each
    # torchrun start costs an agent's and two ranks' start-up)
    by_torchrun = [*TORCHRUN, "--signal-at", str(stops[0]), "--run-dir", "torchrun", "--out", "torchrun.json"]
    for attempt in range(2):  # the same command resumes; torchrun reports a worker's 75 as its own failure
        ended = subprocess.run(by_torchrun, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        stopped = "exitcode  : 75" in ended.stderr
        assert (ended.returncode == 0) == (attempt == 1) and stopped == (attempt == 0), f"{said}, attempt {attempt}: {ended.stderr[-3000:]}"
    assert json.loads((tmp_path / "torchrun.json").read_text())["resumed_from"] == stops[0] + 1, said
    assert step_losses(tmp_path / "torchrun") == expected, said
    assert weights(tmp_path / "torchrun.json") == weights(tmp_path / "ref.json"), said

    work = tmp_path / "work"
    work.mkdir()
    launch = [sys.executable, str(ROOT / "launch.py"), f"script={SCRIPT}", "resources.tasks_per_node=2", f"run_root={work / 'runs'}"]
    args = ["--signal-at", ",".join(map(str, stops)), "--out", str(tmp_path / "launch.json")]
    first = subprocess.run([*launch, "--", *args], cwd=work, capture_output=True, text=True, timeout=300)
    assert first.returncode == EXIT_RESUMABLE, f"{said}: {first.stdout[-2000:]}{first.stderr[-2000:]}"
    assert f"stopped by SIGUSR1 at step {stops[0] + 1}, checkpoint committed; not a Slurm job" in first.stdout, first.stdout[-2000:]
    assert not (tmp_path / "launch.json").exists()  # finish() ended the script: nothing after the loop ran
    (run_dir,) = run_dirs(work)
    for attempt in (1, 2):
        again, resume_env = resume_command(run_dir)
        ended = subprocess.run(again, cwd=work, env=resume_env, capture_output=True, text=True, timeout=300)
        assert ended.returncode == (0 if attempt == 2 else EXIT_RESUMABLE), f"{said}, resume {attempt}: {ended.stdout[-2000:]}{ended.stderr[-2000:]}"
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["resumed_from"], result["steps"], result["restarts"]) == ("completed", stops[1] + 1, ITERS, 2), said
    # hpc.status counts the two relaunches as restarts beside their two interruptions, shows the
    # tokens the script reported to end_step() as a rate, and the validation loss it logged
    status = run_status(RunDir(run_dir), {})
    assert (status.state, status.restarts, status.interrupted.split(":")[0]) == ("COMPLETED", 2, "2 interruptions"), said
    assert status.rate.endswith("tokens/s") and f"val_loss={result['val_metrics']['loss']:.4g}" in status.metrics, (status.rate, status.metrics)
    assert step_losses(run_dir) == expected, said
    assert weights(tmp_path / "launch.json") == weights(tmp_path / "ref.json"), said
    assert result["handle"] is True and set(result["val_metrics"]) == {"loss"}  # what sweep.objective=val_loss reads
    written = export(run_dir, tmp_path / "model.safetensors")  # the model out of the toolkit: the final weights
    tensors, _ = load_safetensors(tmp_path / "model.safetensors")
    assert written["step"] == ITERS and sorted(t.flatten().tolist() for t in tensors.values()) == sorted(weights(tmp_path / "ref.json"))
