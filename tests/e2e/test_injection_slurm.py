"""Names and paths full of shell syntax, submitted to the real Slurm: Slurm sees them literally
and nothing in them runs, neither at submission nor when the batch script and the ranks run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.simcluster import parse_job_id
from hpc.slurm.slurmctl import job_fields
from tests.conftest import wait_until_done
from tests.support.runs import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

# Each a job name and, joined to the test's path, a run_root: quotes, command substitutions,
# separators, globs, comments, backslashes, non-ASCII. (`${...}` is OmegaConf interpolation and
# is refused in one line by design: write `\${...}` for a literal.)
NASTY = ["it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED`", "a;touch PWNED;b", "x && touch PWNED || y", "*#?[a]", "back\\slash \\ end", "é ☃ $HOME"]
# Every kind at once, for the run that really runs: each canary names the syntax that would
# have created it, so a failure says which quoting broke.
CANARIES = ("PWNED_SUBST", "PWNED_BACKTICK", "PWNED_SEMICOLON", "PWNED_AND", "PWNED_DQUOTE")
ALL_AT_ONCE = 'it\'s $(touch PWNED_SUBST) `touch PWNED_BACKTICK` a;touch PWNED_SEMICOLON;b && touch PWNED_AND "$(touch PWNED_DQUOTE)" *?[a] #x'


def hydra_quoted(value: str) -> str:
    """Hydra's override grammar: a double-quoted string with \\ and " escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def launch(name: str, run_root: Path, cwd: Path, *overrides: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), f"name={hydra_quoted(name)}", "cluster=simulated", *overrides, f"run_root={hydra_quoted(str(run_root))}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return parse_job_id(done.stdout)


def slurm_job_name(job_id: str) -> str:
    # -o mode prints one line with space-separated fields; the name runs to " UserId=".
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    return line.split("JobName=", 1)[1].split(" UserId=", 1)[0]


def the_run_dir(run_root: Path) -> Path:
    (run_dir,) = [p.parent for p in run_root.rglob("config.yaml") if not {".hydra", "code"} & set(p.relative_to(run_root).parts)]
    return run_dir


def canaries_found(*roots: Path) -> list[Path]:
    """Any canary file under the given trees (searched recursively) or in a few shallow places a
    command substitution would write to: the batch script's and the ranks' working directories."""
    shallow = [Path.home(), Path("/"), Path("/tmp"), ROOT]
    found = [path for root in roots for path in root.rglob("PWNED*")]
    return found + [place / name for place in shallow for name in (*CANARIES, "PWNED") if (place / name).exists()]


@pytest.mark.parametrize("name", NASTY)
def test_job_names_reach_slurm_literally_and_never_run(tmp_path, name):
    run_root = tmp_path / f"runs {name.replace(chr(92), '')}"  # Hydra keeps a path's backslashes doubled
    job_id = launch(name, run_root, tmp_path, "hold=true")
    try:
        assert slurm_job_name(job_id) == name
        assert job_fields(job_id).get("JobState") == "PENDING"
    finally:
        subprocess.run(["scancel", job_id], check=False)
    assert not canaries_found(tmp_path)
    assert the_run_dir(run_root).name.endswith(name) or "\\" in name  # Hydra doubles backslashes in its run dir name


def test_a_job_with_a_hostile_name_and_run_root_runs_to_completion_and_runs_nothing_of_them(tmp_path):
    """Released, not held: the batch script (its #SBATCH lines, exports, srun line, EXIT trap)
    and both ranks really run with the hostile text in the job name and in every path."""
    run_root = tmp_path / f"runs {ALL_AT_ONCE}"
    job_id = launch(ALL_AT_ONCE, run_root, tmp_path, "resources.tasks_per_node=2", "trainer.max_steps=6", "checkpoint.every_steps=3")
    assert slurm_job_name(job_id) == ALL_AT_ONCE
    assert wait_until_done(job_id) == "COMPLETED"

    run_dir = the_run_dir(run_root)
    assert run_dir.parent.parent == run_root and run_dir.name.endswith(f"_{ALL_AT_ONCE}")  # the literal path, unexpanded
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["steps"], result["world_size"]) == ("completed", 6, 2), result
    assert json.loads((run_dir / "job.json").read_text())["job_id"] == job_id
    assert (run_dir / "checkpoints" / "step-000000006" / "COMMITTED").is_file()
    assert list((run_dir / "slurm" / job_id).glob(f"{job_id}_*_log.out"))  # Slurm wrote under the literal path too
    found = canaries_found(tmp_path)
    assert not found, f"hostile text ran: {found}"


def test_any_sbatch_option_reaches_slurm_with_its_value_literal(tmp_path):
    """cluster.sbatch: `scontrol show job` shows each option, the hostile comment as typed."""
    options = ["+cluster.sbatch.mail-type=END", "+cluster.sbatch.exclusive=true", "+cluster.sbatch.nice=7"]
    options.append(f"+cluster.sbatch.comment={hydra_quoted(ALL_AT_ONCE)}")
    job_id = launch("options", tmp_path / "runs", tmp_path, "hold=true", *options)
    try:
        fields = job_fields(job_id)
        assert (fields["MailType"], fields["OverSubscribe"], fields["Nice"]) == ("END", "NO", "7"), fields
        line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
        assert f"Comment={ALL_AT_ONCE} " in line
        script = (the_run_dir(tmp_path / "runs") / "job.sbatch").read_text()
        assert "#SBATCH --mail-type=END" in script and "#SBATCH --exclusive" in script
    finally:
        subprocess.run(["scancel", job_id], check=False)
    assert not canaries_found(tmp_path)


def test_every_option_the_installed_sbatch_lists_is_one_cluster_sbatch_knows():
    from hpc.slurm.options import KNOWN

    listed = subprocess.run(["sbatch", "--help"], capture_output=True, text=True, check=True).stdout
    options = set(re.findall(r"--([a-z][a-z0-9-]*)", listed)) - {"help", "usage", "version", "verbose", "quiet"}
    assert options and not options - KNOWN, sorted(options - KNOWN)
