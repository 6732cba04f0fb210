"""`python launch.py` in a terminal (a pseudo-terminal here), as a person runs it: Ctrl-C stops
the ranks at a step with a committed checkpoint and prints the command that resumes; a second
Ctrl-C ends them at once; log lines never run on from the end of the progress bar."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from hpc.rankprocs import is_rank_of, process_facts
from hpc.rundir import RunDir
from tests.support.runs import ROOT, run_dirs, stopped_pattern
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.layout import committed_steps
from trainers.watchdog import read_heartbeats

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def run_in_terminal(cwd: Path, overrides: list[str], keys: bytes, after: bytes, again_after_s: float | None = None, timeout_s: float = 120) -> tuple[str, int]:
    """launch.py on a pseudo-terminal; `keys` typed once the screen shows `after` (and once more
    `again_after_s` later: signals do not queue, two at once would arrive as one). Returns what
    the terminal showed and the exit code."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: launch.py with the terminal as its stdin, stdout and stderr
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 200, 0, 0))  # 200 columns: the whole bar fits
        os.chdir(cwd)
        os.environ["PYTHONPATH"] = str(ROOT)
        os.execv(sys.executable, [sys.executable, str(ROOT / "launch.py"), *overrides, f"run_root={cwd / 'runs'}"])
    shown, typed, deadline = b"", False, time.monotonic() + timeout_s
    typed_at: float | None = None
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child side closed
                break
            if not chunk:
                break
            shown += chunk
        if not typed and after in shown:
            os.write(fd, keys)
            typed, typed_at = True, time.monotonic()
        elif again_after_s is not None and typed_at is not None and time.monotonic() >= typed_at + again_after_s:
            os.write(fd, keys)
            again_after_s = None
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    return shown.decode(errors="replace"), os.waitstatus_to_exitcode(status)


def live_rank_pids(run_dir: Path, within_s: float = 5.0) -> list[int]:
    """The ranks of `run_dir` (by their heartbeats' pids) still running `within_s` after now:
    a killed rank's parent reaps it at once, one whose parent died passes to init first."""
    beats, deadline = read_heartbeats(RunDir(run_dir).heartbeats), time.monotonic() + within_s
    assert beats, f"no heartbeat in {run_dir}"
    while True:
        live = [beat.pid for beat in beats if (found := process_facts(beat.pid)) is not None and is_rank_of(*found, beat, run_dir)]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.05)  # polled: nothing to wait on for another's process


def test_ctrl_c_in_a_terminal_stops_at_a_step_saves_and_prints_the_resume_command(tmp_path):
    # after 44 steps (the bar shows some of them: tqdm draws at most 10 times a second)
    shown, code = run_in_terminal(tmp_path, ["trainer.epochs=30", "checkpoint.every_minutes=null"], b"\x03", after=b"epoch 2/30")
    assert code == 75, shown[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "stopped" and committed_steps(run_dir / "checkpoints")[-1] == result["steps"] >= 30
    assert re.search(stopped_pattern("SIGINT", result["steps"]), shown), shown[-2000:]
    assert f"to resume: bash {run_dir / 'command.txt'}" in shown
    assert "Traceback" not in shown and "Input/output error" not in shown
    # Every log line starts on a line of its own: tqdm's bar is lifted first (or a line ended).
    assert re.search(r"\rstep \d+/\d+  loss [\d.]+ .* \d+% \[", shown), shown[-2000:]  # the bar: the step's line, then tqdm's
    for line in ("epoch 1/30", f"checkpoint step {result['steps']} committed", "stopped by SIGINT"):
        at = shown.index(line)
        assert shown[:at].endswith(("\r", "\n")), repr(shown[at - 80 : at + 20])


def test_a_second_ctrl_c_ends_the_ranks_at_once_and_the_checkpoints_before_it_still_load(tmp_path):
    """A wide model: a step and the stop's save (about 200 MB) each take far longer than the
    0.1 s between the two Ctrl-Cs, so the second one lands before the save can commit. The
    checkpoint committed before the first Ctrl-C must come through whole: it is what resumes."""
    job = ["model.hidden_sizes=[4096,4096]", "trainer.epochs=30", "checkpoint.every_minutes=null", "checkpoint.every_steps=2"]
    shown, code = run_in_terminal(tmp_path, job, b"\x03", after=b" committed", again_after_s=0.1)
    assert "second Ctrl-C: ending the ranks now" in shown and code == 130, shown[-2000:]  # as a shell's Ctrl-C
    (run_dir,) = run_dirs(tmp_path)
    assert f"the newest committed checkpoint stays the newest; to resume: bash {run_dir / 'command.txt'}" in shown
    assert not re.search(r"stopped by SIGINT at step \d+, checkpoint committed", shown)  # the stop's save never committed
    assert not live_rank_pids(run_dir)  # mpirun's ranks, each in a group of its own, and the warm process's forks ended with it
    committed = committed_steps(run_dir / "checkpoints")
    assert committed and f"checkpoint step {committed[0]} committed" in shown
    ranks = len(list((run_dir / "logs").glob("rank-*.log")))
    restored = Checkpointer(run_dir / "checkpoints", 0, ranks, keep=3).load_latest()
    assert restored is not None and restored[0] == committed[-1]  # the newest committed one loads: nothing lost or torn
