"""Names and paths full of shell syntax, submitted to the real Slurm: Slurm sees them literally
and nothing in them runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpc.requeue import job_fields
from tests.support.runs import ROOT
from benchmarks.simcluster import parse_job_id

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

# Each a job name and, joined to the test's path, a run_root: quotes, command substitutions,
# separators, globs, comments, backslashes, non-ASCII. (`${...}` is OmegaConf interpolation and
# is refused in one line by design: write `\${...}` for a literal.)
NASTY = ["it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED`", "a;touch PWNED;b", "x && touch PWNED || y", "*#?[a]", "back\\slash \\ end", "é ☃ $HOME"]


def hydra_quoted(value: str) -> str:
    """Hydra's override grammar: a double-quoted string with \\ and " escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@pytest.mark.parametrize("name", NASTY)
def test_job_names_reach_slurm_literally_and_never_run(tmp_path, name):
    run_root = tmp_path / f"runs {name.replace(chr(92), '')}"  # Hydra keeps a path's backslashes doubled
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), f"name={hydra_quoted(name)}", "cluster=simulated", "hold=true",
                           f"run_root={hydra_quoted(str(run_root))}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    job_id = parse_job_id(done.stdout)
    try:
        # -o mode prints one line with space-separated fields; the name runs to " UserId=".
        line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
        assert line.split("JobName=", 1)[1].split(" UserId=", 1)[0] == name
        assert job_fields(job_id).get("JobState") == "PENDING"
    finally:
        subprocess.run(["scancel", job_id], check=False)
    assert not list(tmp_path.rglob("PWNED")) and not (ROOT / "PWNED").exists()
    (run_dir,) = [p.parent for p in run_root.rglob("config.yaml") if not {".hydra", "code"} & set(p.relative_to(run_root).parts)]
    assert run_dir.name.endswith(name) or "\\" in name  # Hydra doubles backslashes in its run dir name
