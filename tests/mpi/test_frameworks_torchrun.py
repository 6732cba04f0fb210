"""hpc.lightning without launch.py: a Lightning script started by torchrun with a run dir
(HPCTK_RUN_DIR) is stopped by a signal to its ranks, and the same command resumes it to the
per-step losses and final state of an uninterrupted torchrun run. The run handle talks through
the process group, which Lightning starts only inside fit(): hpc.lightning starts it first, as
Lightning would. (Under launch.py and on Slurm: tests/mpi/test_verify.py and
tests/e2e/test_verify_slurm.py; Hugging Face's Trainer starts its process group itself.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.simcluster import poll
from hpc.verify.compare import compare_states, final_state
from tests.support.runs import ROOT, logged_steps, ranks_environment, step_losses

pytestmark = [pytest.mark.mpi]

SCRIPT = ROOT / "examples" / "lightning" / "train.py"
ARGS = ["--max-steps", "400", "--val-every", "32"]


def torchrun(run_dir: Path, cwd: Path) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *ARGS]
    env = {**ranks_environment(), "HPCTK_RUN_DIR": str(run_dir)}
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def workers(agent: int) -> list[int]:
    """torchrun's worker processes: the agent's children."""
    found = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def test_a_lightning_script_under_torchrun_stops_on_a_signal_and_resumes_exactly(tmp_path):
    reference = torchrun(tmp_path / "reference", tmp_path)
    assert reference.wait(timeout=300) == 0, reference.stdout.read()[-3000:] if reference.stdout else ""

    stopped = torchrun(tmp_path / "run", tmp_path)
    poll(lambda: logged_steps(tmp_path / "run") >= 5 or stopped.poll() is not None, "the run's first steps")
    for pid in workers(stopped.pid):
        os.kill(pid, signal.SIGUSR1)
    first = stopped.communicate(timeout=300)[0]
    assert stopped.returncode != 0 and "exitcode  : 75" in first, first[-3000:]  # torchrun reports a worker's 75 as its failure
    (step,) = {int(n) for n in re.findall(r"stopped by SIGUSR1(?: \(received during [a-z ]+\))? at step (\d+), checkpoint committed", first)}

    again = torchrun(tmp_path / "run", tmp_path)
    second = again.communicate(timeout=300)[0]
    assert again.returncode == 0 and f"resumed from checkpoint step {step}" in second, second[-3000:]
    assert step < 400 and step_losses(tmp_path / "run") == step_losses(tmp_path / "reference")
    compared = compare_states(final_state(tmp_path / "reference")[0], final_state(tmp_path / "run")[0])
    assert compared.tensors > 20 and not compared.differing, compared.differing[:5]
