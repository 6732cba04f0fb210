"""A real straggler: rank 1 shares its core with a busy loop, rank 0 has a core to itself. The
ranks wait for each other in every allreduce, so their step times are equal; their busy times
are not, and the report names rank 1 and its host."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, run_dirs
from tests.mpi.test_resume import logged_steps
from trainers.watchdog import heartbeat_file

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def test_a_rank_on_a_busy_core_is_reported_as_the_straggler(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    launched = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "model.hidden_sizes=[512,512]", "trainer.max_steps=150", "trainer.epochs=100",
                                 "trainer.straggler_every=10", "trainer.straggler_ratio=1.2", f"run_root={tmp_path / 'runs'}"],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not run_dirs(tmp_path) or logged_steps(run_dirs(tmp_path)[0]) < 2:
        assert launched.poll() is None and time.monotonic() < deadline, launched.stderr.read() if launched.poll() is not None else "slow start"
        time.sleep(0.01)  # polling the step log
    (run_dir,) = run_dirs(tmp_path)
    cores = sorted(os.sched_getaffinity(0))[:2]
    pids = [json.loads(heartbeat_file(run_dir / "heartbeats", rank).read_text())["pid"] for rank in (0, 1)]
    os.sched_setaffinity(pids[0], {cores[0]})
    os.sched_setaffinity(pids[1], {cores[1]})
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(burner.pid, {cores[1]})
    try:
        assert launched.wait(timeout=300) == 0, launched.stderr.read()
    finally:
        burner.kill()
    reports = [json.loads(line)["straggler"] for line in (run_dir / "steps.jsonl").read_text().splitlines() if "straggler" in line]
    assert reports, "no straggler reported"
    assert {r["rank"] for r in reports[-3:]} == {1} and reports[-1]["host"] == socket.gethostname()
    assert "straggler: rank 1 on" in (run_dir / "logs" / "rank-00000.log").read_text()
