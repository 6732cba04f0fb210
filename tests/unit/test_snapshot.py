"""Code frozen at submission: what is copied, and the git record of it."""

from __future__ import annotations

import json
import subprocess

from hpc.submit.snapshot import freeze_code


def _project(root):
    for name, text in {
        "hpc/__init__.py": "",
        "hpc/a.py": "A = 1\n",
        "trainers/b.py": "B = 2\n",
        "collectives/c.py": "",
        "hpc/conf/x/y.yaml": "k: 1\n",  # the configs are package data of hpc
        "hpc/__pycache__/a.cpython-311.pyc": "junk",
        "hpc/notes.txt": "not code",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_sources_are_copied_and_nothing_else(tmp_path):
    root = tmp_path / "project"
    _project(root)
    frozen = freeze_code(tmp_path / "run" / "code", root)
    copied = sorted(str(p.relative_to(frozen)) for p in frozen.rglob("*") if p.is_file())
    assert copied == ["SOURCE.json", "collectives/c.py", "hpc/__init__.py", "hpc/a.py", "hpc/conf/x/y.yaml", "trainers/b.py"]
    (root / "hpc/a.py").write_text("A = 'edited after submission'\n")
    assert (frozen / "hpc/a.py").read_text() == "A = 1\n"
    assert json.loads((frozen / "SOURCE.json").read_text())["git_commit"] is None


def test_git_commit_and_uncommitted_changes_are_recorded(tmp_path):
    root = tmp_path / "project"
    _project(root)
    git = ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    clean = json.loads((freeze_code(tmp_path / "r1", root) / "SOURCE.json").read_text())
    assert len(clean["git_commit"]) == 40 and clean["dirty"] is False and not (tmp_path / "r1" / "git.diff").exists()
    (root / "trainers/b.py").write_text("B = 3\n")
    dirty = freeze_code(tmp_path / "r2", root)
    assert json.loads((dirty / "SOURCE.json").read_text())["dirty"] is True
    assert "+B = 3" in (dirty / "git.diff").read_text()
