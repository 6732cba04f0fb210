"""A script launched again and again from its own folder with the default run_root (runs/, in
that folder): every launch freezes the same files, never the earlier runs' copies of the
toolkit (issue 44: 147, 440, 1026 files, and the fourth launch refused)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpc.rundir import RUN_MARKER
from tests.support.runs import ROOT, run_dirs

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

SCRIPT = 'import os\nprint("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])\n'


def test_the_same_script_launches_ten_times_from_its_own_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "t.py").write_text(SCRIPT)
    # The first and the last launch run their ranks; the eight between take launch.py's whole
    # path (validation, the run dir, the frozen code, command.txt) with an mpirun that starts
    # none, which saves about 4 s each. (find_mpirun prefers an mpirun next to the interpreter:
    # where there is one, those eight run their ranks too, only slower.)
    stub = tmp_path / "bin" / "mpirun"
    stub.parent.mkdir()
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    no_ranks = {**os.environ, "PATH": f"{stub.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    frozen = []
    for launch in range(10):
        real = launch in (0, 9)
        done = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "script=t.py", "resources.tasks_per_node=1"],  # run_root: the default, runs/ here
            cwd=work,
            env=None if real else no_ranks,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"launch {launch + 1}: {done.stdout[-1000:]}{done.stderr[-2000:]}"
        if real:
            assert "rank 0 of 1" in done.stdout, done.stdout[-2000:]
        runs = run_dirs(work)
        assert len(runs) == launch + 1
        assert (runs[-1] / RUN_MARKER).is_file()  # what a later freeze leaves out, wherever the run dir is
        code = runs[-1] / "code"
        assert sorted(str(p.relative_to(code / "script")) for p in (code / "script").rglob("*")) == ["t.py"]
        frozen.append(json.loads((code / "SOURCE.json").read_text())["files"])
    assert frozen == [frozen[0]] * 10, frozen
    assert json.loads((run_dirs(work)[-1] / "result.json").read_text())["status"] == "completed"
