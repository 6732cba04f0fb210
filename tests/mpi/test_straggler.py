"""A real straggler: rank 1 sleeps 100 ms in every training step (tests/fixtures/mytasks/
straggling.py), as a rank on a slow disk or a throttled GPU spends the time. The ranks wait for
each other in every allreduce, so their step times are equal; their busy times are not, and the
report names rank 1 and its host. (With two ranks the median is their mean: rank 1's busy time
is over 1.3x that mean while a step's own work stays under 35 ms, whatever the machine's load.
An earlier form stopped rank 1 with SIGSTOP 30 ms of every 40; under a loaded machine's
scheduling its busy share fell below the threshold, and it failed once in a CI run.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.support.runs import ROOT, fixtures_env, run_dirs

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def test_a_rank_that_sleeps_in_every_step_is_reported_as_the_straggler(tmp_path):
    launched = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch.py"),
            "task._target_=mytasks.straggling.Straggling",
            "trainer.max_steps=30",
            "trainer.epochs=100",
            "trainer.straggler_every=10",
            "trainer.straggler_ratio=1.3",
            f"run_root={tmp_path / 'runs'}",
        ],
        cwd=tmp_path,
        env=fixtures_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr
    (run_dir,) = run_dirs(tmp_path)
    reports = [json.loads(line)["straggler"] for line in (run_dir / "steps.jsonl").read_text().splitlines() if "straggler" in line]
    assert len(reports) == 3, f"a straggler at each of the 3 checks (steps 10, 20, 30): {reports}"
    assert {r["rank"] for r in reports} == {1} and reports[-1]["host"] == socket.gethostname()
    assert "straggler: rank 1 on" in (run_dir / "logs" / "rank-00000.log").read_text()
