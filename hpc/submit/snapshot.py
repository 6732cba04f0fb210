"""Freeze the code a job runs when it starts: at submission (Slurm), or at launch (local).

A job that waits in the queue, is requeued a day later, or a local run resumed next week from
its command.txt, must run the code it started with, not whatever the checkout holds by then.
We copy the packages' sources (a few hundred KB) into the run (or sweep) directory and put that
copy first on the ranks' PYTHONPATH (the sbatch script, hpc.submit.slurm; the mpirun command, hpc.submit.local);
SOURCE.json records the git commit and whether the tree was dirty, git.diff the changes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from hpc.rundir import PROJECT_ROOT

PACKAGES = ("hpc", "trainers", "collectives")
SOURCE_SUFFIXES = {".py", ".yaml"}


def _git(args: list[str], root: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def freeze_code(dest: Path, root: Path = PROJECT_ROOT) -> Path:
    """Copy the sources under `root` into `dest` (created; must not exist); returns `dest`."""
    dest.mkdir(parents=True)
    copied = 0
    for package in (*PACKAGES, "conf"):
        for source in sorted((root / package).rglob("*")):
            if source.is_file() and source.suffix in SOURCE_SUFFIXES and "__pycache__" not in source.parts:
                target = dest / source.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)  # new mode from the umask (run_access), not the checkout's
                copied += 1
    commit = _git(["rev-parse", "HEAD"], root)
    diff = _git(["diff", "HEAD", "--", *PACKAGES, "conf"], root) if commit else None
    if diff:
        (dest / "git.diff").write_text(diff)
    source_info = {"root": str(root), "files": copied, "git_commit": commit.strip() if commit else None, "dirty": bool(diff)}
    (dest / "SOURCE.json").write_text(json.dumps(source_info, indent=2, sort_keys=True) + "\n")
    return dest
