"""Code frozen at submission: what is copied, and the git record of it."""

from __future__ import annotations

import json
import subprocess

from hpc.launching.snapshot import freeze_code, store_of


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


def test_unchanged_files_are_shared_between_run_dirs_through_the_run_roots_store(tmp_path):
    """Each run dir keeps a whole copy of its code (1.7 MB of the toolkit's alone), but an
    unchanged file is one read-only file in the run root's store, hard-linked from every run dir;
    a file changed between two runs gets its own."""
    root = tmp_path / "project"
    _project(root)
    store = store_of(tmp_path / "runs")
    first = freeze_code(tmp_path / "runs" / "1" / "code", root, store=store)
    (root / "hpc/a.py").write_text("A = 'changed before the second run'\n")
    second = freeze_code(tmp_path / "runs" / "2" / "code", root, store=store)
    same, changed = (first / "trainers/b.py").stat(), (first / "hpc/a.py").stat()
    assert (second / "trainers/b.py").stat().st_ino == same.st_ino and same.st_nlink == 3  # the store's and two runs'
    assert (second / "hpc/a.py").stat().st_ino != changed.st_ino and (second / "hpc/a.py").read_text() == "A = 'changed before the second run'\n"
    assert (first / "hpc/a.py").read_text() == "A = 1\n" and not same.st_mode & 0o222  # read-only: no run edits another's
    assert store.parent == tmp_path / "runs" / ".frozen" and store.name.startswith("umask-")


def test_a_discarded_run_leaves_no_store_behind_but_a_kept_runs_files_stay(tmp_path):
    """A refused submission or a dry run removes its run dir and the folders it made: the run
    root's store goes too, save the files another run dir still links."""
    import shutil

    from hpc.launching import tidy

    root = tmp_path / "project"
    _project(root)
    runs = tmp_path / "work" / "runs"
    tidy.note_run_root(runs)  # tmp_path/work does not exist yet: everything below tmp_path is this command's
    store = store_of(runs)
    discarded = runs / "2026-12-02" / "1"
    freeze_code(discarded / "code", root, store=store)
    shutil.rmtree(discarded)
    tidy.prune_empty(discarded)
    assert not (tmp_path / "work").exists()

    kept = freeze_code(runs / "2026-12-02" / "2" / "code", root, store=store)
    (root / "hpc/a.py").write_text("A = 'only the discarded run has this'\n")
    freeze_code(discarded / "code", root, store=store)
    shutil.rmtree(discarded)
    tidy.prune_empty(discarded)
    left = sorted(p.name for p in store.rglob("*") if p.is_file())
    assert len(left) == len([p for p in kept.rglob("*") if p.is_file() and p.name != "SOURCE.json"])
    assert (kept / "hpc/a.py").read_text() == "A = 1\n"
