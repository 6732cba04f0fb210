"""What of a script's folder is frozen with a job (hpc.config.freezing): its code, never the
toolkit's own output (the run root, run dirs), data or output folders, environments or .git."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hpc.config.freezing import frozen_files, left_out, walked
from hpc.config.schema import to_job_config
from hpc.config.scripts import check_script
from hpc.config.validate import validate_job
from hpc.errors import UserError
from hpc.launching.snapshot import freeze_code, freeze_job_code
from hpc.launching.sweep import SweepPoint, write_point_dirs
from hpc.rundir import RUN_MARKER, mark_run_dir
from hpc.slurm.prepare import job_run_dir

ROOT = Path("/work/proj")


@pytest.mark.parametrize(
    ("below", "names", "why"),
    [
        ("", ["runs", "t.py"], None),  # the frozen directory itself, whatever it holds
        ("runs", [], "the run root"),
        ("old/2026-11-27/10-00-00_train", [RUN_MARKER, "config.yaml", "code"], "a run directory"),
        ("sweeps/x", [RUN_MARKER, "sweep.json", "0"], "a run directory"),
        (".git", ["HEAD"], "a hidden directory"),
        ("pkg/.hydra", ["config.yaml"], "a hidden directory"),
        ("venv", ["pyvenv.cfg", "lib"], "a virtual environment"),
        ("tools/env", ["conda-meta", "lib"], "a virtual environment"),
        ("pkg/__pycache__", ["a.cpython-311.pyc"], "bytecode"),
        ("data", ["prepare.py", "train.bin"], "data or output, not a package"),
        ("outputs", ["2026-11-27"], "data or output, not a package"),
        ("checkpoints", ["step-1"], "data or output, not a package"),
        ("data", ["__init__.py", "loaders.py"], None),  # a package the script imports
        ("conf/data", ["digits.yaml"], None),  # below the top: a Hydra config group
        ("pkg/runs", ["a.py"], None),
        ("model", ["gpt.py"], None),
    ],
)
def test_the_rule_names_why_a_directory_is_left_out(below, names, why):
    assert left_out(ROOT / below if below else ROOT, ROOT, names, skip=[ROOT / "runs"]) == why


def write(path: Path, text: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def script_folder(root: Path) -> list[str]:
    """A script's folder after some launches and some data: returns what of it is code."""
    code = ["conf/config.yaml", "conf/data/small.yaml", "datasets/__init__.py", "datasets/shards.py", "model.py", "t.py"]
    for name in code:
        write(root / name)
    write(root / "notes.txt")  # neither .py nor .yaml
    write(root / "runs/2026-11-27/10-00-00_train/code/hpc/a.py")  # the run root: the toolkit's copies
    write(root / "runs/2026-11-27/10-00-00_train/config.yaml")
    mark_run_dir(root / "elsewhere/10-00-00_train")  # a run dir under another run_root
    write(root / "elsewhere/10-00-00_train/code/hpc/a.py")
    write(root / "data/shakespeare/prepare.py")  # nanoGPT's data folder: not imported by train.py
    write(root / "outputs/2026-11-27/10-00-00/.hydra/config.yaml")  # Hydra's own runs
    write(root / ".venv/lib/python3.11/site-packages/torch/__init__.py")
    write(root / "env/pyvenv.cfg")
    write(root / "env/lib/x.py")
    write(root / ".git/hooks/pre-commit.py")
    write(root / "__pycache__/model.cpython-311.pyc")
    return code


def test_a_scripts_folder_freezes_its_code_and_none_of_its_runs_data_or_environments(tmp_path):
    code = script_folder(tmp_path)
    assert [str(p.relative_to(tmp_path)) for p in frozen_files(tmp_path, skip=[tmp_path / "runs"])] == code
    # Without the run root named, its run dirs go by their marker, or by its name at the top
    assert [str(p.relative_to(tmp_path)) for p in frozen_files(tmp_path)] == code
    # What else a script may read beside its code is linked: never a run root, a run dir, an
    # environment, a hidden folder or bytecode
    for skip in ([tmp_path / "runs"], []):
        assert [str(p.relative_to(tmp_path)) for p in walked(tmp_path, skip)[1]] == ["data", "notes.txt", "outputs"]


def test_a_script_reads_the_live_files_beside_it_through_links_in_its_frozen_copy(tmp_path):
    script_folder(tmp_path / "work")
    write(tmp_path / "work" / "vocab" / "words.json", "[1]")
    frozen = freeze_code(tmp_path / "run" / "code", tmp_path / "project", script_dir=tmp_path / "work", skip=[tmp_path / "work" / "runs"])
    copy = frozen / "script"
    assert (copy / "model.py").is_file() and not (copy / "model.py").is_symlink()  # code: frozen
    linked = sorted(str(p.relative_to(copy)) for p in copy.rglob("*") if p.is_symlink())
    assert linked == ["data", "notes.txt", "outputs", "vocab/words.json"]
    (tmp_path / "work" / "vocab" / "words.json").write_text("[2]")
    assert (copy / "vocab" / "words.json").read_text() == "[2]"  # data: read live, as torchrun's script reads it
    assert (copy / "data" / "shakespeare" / "prepare.py").is_file()
    assert not (copy / "runs").exists() and not (copy / ".venv").exists() and not (copy / "env").exists()


def test_the_limit_counts_only_what_is_frozen(tmp_path, monkeypatch):
    monkeypatch.setattr("hpc.config.scripts.MAX_FROZEN_FILES", 6)
    script_folder(tmp_path)
    assert check_script("t.py", tmp_path, skip=[tmp_path / "runs"]).path == tmp_path / "t.py"
    write(tmp_path / "lib" / "extra.py")
    with pytest.raises(UserError, match="holds 7 source files"):
        check_script("t.py", tmp_path, skip=[tmp_path / "runs"])


def test_a_copy_written_inside_the_scripts_folder_is_not_copied_into_itself(tmp_path):
    """The run dir of this very launch sits in the script's folder (run_root=runs); even unmarked,
    under a run_root not named, the copy being written is left out."""
    project = tmp_path / "project"
    write(project / "hpc" / "a.py")
    write(tmp_path / "work" / "t.py")
    frozen = freeze_code(tmp_path / "work" / "mine" / "run" / "code", project, script_dir=tmp_path / "work")
    assert sorted(str(p.relative_to(frozen)) for p in frozen.rglob("*") if p.is_file()) == ["SOURCE.json", "hpc/a.py", "script/t.py"]
    assert json.loads((frozen / "SOURCE.json").read_text())["files"] == 2


def test_a_jobs_run_root_is_left_out_of_its_scripts_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # run_root is relative to where launch.py runs
    write(tmp_path / "t.py")
    write(tmp_path / "results" / "2026-11-27" / "10-00-00_train" / "config.yaml")  # a run made before the marker existed
    job = replace(to_job_config({}), script=str(tmp_path / "t.py"), workdir=str(tmp_path), run_root="results")
    code = freeze_job_code(tmp_path / "code-copy", job)
    assert sorted(p.name for p in (code / "script").rglob("*")) == ["t.py"]


def test_validation_counts_the_scripts_folder_without_the_jobs_run_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("hpc.config.scripts.MAX_FROZEN_FILES", 3)
    write(tmp_path / "t.py")
    for run in range(3):  # earlier runs under a run_root of another name, made before the marker existed
        write(tmp_path / "results" / f"run-{run}" / "code" / "hpc" / "a.py")
    job = replace(to_job_config({}), script=str(tmp_path / "t.py"), workdir=str(tmp_path), run_root="results")
    assert validate_job(job) is None
    with pytest.raises(UserError, match="holds 4 source files"):
        validate_job(replace(job, run_root="elsewhere"))


def test_every_run_and_sweep_dir_the_toolkit_makes_is_marked(tmp_path):
    job = replace(to_job_config({}), run_root=str(tmp_path / "runs"))
    write_point_dirs([SweepPoint(0, ("optim.lr=0.1",), job), SweepPoint(1, ("optim.lr=0.2",), job)], tmp_path / "sweep")
    assert all((tmp_path / "sweep" / name / RUN_MARKER).is_file() for name in ("", "0", "1"))
    run_dir, existed = job_run_dir(job, "12")  # a hand-typed sbatch script's run dir (hpc.slurm.prepare)
    assert not existed and (run_dir.path / RUN_MARKER).is_file()
    # launch.py's own run dirs: tests/mpi/test_relaunch.py
