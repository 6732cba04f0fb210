"""A local run: Ctrl-C stops it cleanly and says so, and its command.txt resumes the code frozen
at launch from any working directory, whatever PYTHONPATH the person resuming it has."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from hpc.launching.snapshot import freeze_code
from tests.support.runs import ROOT, logged_steps, resume_command, run_dirs, stopped_pattern

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

CODE_LINE = re.compile(r"\] INFO hpc\.rank: code: (\S+)$", re.M)


def test_ctrl_c_stops_cleanly_and_command_txt_resumes_the_frozen_code_from_anywhere(tmp_path):
    # Ctrl-C in a terminal: SIGINT to launch.py (mpirun has a session of its own).
    launch = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "trainer.epochs=100", "checkpoint.every_minutes=null", f"run_root={tmp_path / 'runs'}"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 90
    while not run_dirs(tmp_path) or logged_steps(run_dirs(tmp_path)[0]) < 3:
        assert launch.poll() is None and time.monotonic() < deadline, launch.communicate()[1][-2000:] if launch.poll() is not None else "slow start"
        time.sleep(0.01)  # polling the step log: there is no event to wait on
    launch.send_signal(signal.SIGINT)
    stdout, stderr = launch.communicate(timeout=120)
    (run_dir,) = run_dirs(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["exit_code"]) == ("stopped", 75), stderr[-2000:]
    resume = r"; not a Slurm job: run its command\.txt \(or start the same run dir again\) to resume \(exit code 75\)"
    assert re.search(stopped_pattern("SIGINT", result["steps"]) + resume, stdout), stdout[-2000:]
    log = run_dir / "logs" / "rank-00000.log"
    frozen = run_dir / "code"
    assert (frozen / "hpc" / "rank" / "main.py").is_file() and (frozen / "SOURCE.json").is_file()
    assert CODE_LINE.findall(log.read_text()) == [str(frozen)]

    # Resume for two more steps with a second checkout first on PYTHONPATH and the live one as
    # the working directory: python -m would import either unless the command pins the frozen copy.
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("max_steps: null", f"max_steps: {result['steps'] + 2}"))
    elsewhere = freeze_code(tmp_path / "another-checkout")
    command, env = resume_command(run_dir)
    resumed = subprocess.run(command, env={**env, "PYTHONPATH": str(elsewhere)}, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((run_dir / "result.json").read_text())["resumed_from"] == result["steps"]
    assert CODE_LINE.findall(log.read_text()) == [str(frozen)] * 2
