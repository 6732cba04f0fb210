"""Run directories, logs and checkpoints are private to the user unless configured otherwise."""

from __future__ import annotations

import stat

import pytest

from tests.support.runs import run_dirs, run_launch

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def modes(run_dir):
    return {str(p.relative_to(run_dir)): stat.S_IMODE(p.stat().st_mode) for p in [run_dir, *run_dir.rglob("*")]}


@pytest.mark.parametrize(("access", "forbidden"), [("private", 0o077), ("group", 0o027)])
def test_nothing_in_a_run_dir_is_readable_beyond_what_run_access_allows(tmp_path, access, forbidden):
    done = run_launch("trainer.epochs=1", f"run_access={access}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = run_dirs(tmp_path)
    found = modes(run_dir)
    for name in ("config.yaml", "logs/rank-00000.log", "heartbeats/rank-00001.json", "checkpoints", "result.json"):
        assert name in found, sorted(found)
    assert any(name.endswith("shared.ckpt") for name in found)
    too_open = {name: oct(mode) for name, mode in found.items() if mode & forbidden}
    assert not too_open
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) & forbidden == 0
    if access == "group":
        assert found["config.yaml"] & stat.S_IRGRP and found["checkpoints"] & stat.S_IXGRP


def test_an_unknown_run_access_is_one_line(tmp_path):
    done = run_launch("run_access=world", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.strip() == "error: run_access='world' is not one of private, group, umask"
