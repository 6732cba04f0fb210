"""`from hpc import submit` is a function of `hpc` however the process imported the toolkit before
(the launching package is hpc.launching, no longer a package of the same name made callable), and
it refuses in this process, with launch.py's line, leaving nothing behind and the process as it was."""

from __future__ import annotations

import os

import pytest


def process_state() -> tuple[int, str, dict[str, str]]:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask, os.getcwd(), dict(os.environ)


def test_submit_is_a_function_of_hpc_even_after_the_launching_package_was_imported(tmp_path):
    import hpc.slurm.batch  # noqa: F401 - what any launcher-side import does first
    from hpc import SubmitError, submit

    assert callable(submit) and not hasattr(submit, "__path__")
    before = process_state()
    with pytest.raises(SubmitError, match=r"^unknown key 'optim.lrr'; valid keys in 'optim': name, lr"):
        submit("optim.lrr=0.1", "run_access=private", cwd=tmp_path)
    assert not list(tmp_path.iterdir())  # refused: nothing left behind
    assert process_state() == before


@pytest.mark.parametrize(
    ("overrides", "refusal"),
    [
        (("--cfg", "job"), r"^--help, --cfg, --info and --version print and submit nothing"),
        (("dry_run=true",), r"^dry_run=true submits nothing"),
        (("verify=resume",), r"^verify=resume runs the verifier in the foreground"),
        (("--bogus",), r"^unrecognized arguments: --bogus"),
    ],
)
def test_what_only_the_command_line_does_is_refused_in_one_line(tmp_path, overrides, refusal):
    from hpc import SubmitError, submit

    with pytest.raises(SubmitError, match=refusal):
        submit(*overrides, cwd=tmp_path)
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]


def test_a_refusal_after_the_run_dir_was_made_leaves_nothing_and_the_process_as_it_was(tmp_path, monkeypatch):
    """mpirun missing is found once the run dir exists (and run_access=private set the umask):
    the run dir goes, with the date folder made for it, and the umask comes back."""
    from hpc import SubmitError, submit
    from hpc.launching import local

    monkeypatch.setattr(local, "find_mpirun", lambda: None)
    before = process_state()
    with pytest.raises(SubmitError, match=r"^mpirun not found: run scripts/install.sh$"):
        submit("run_access=private", "+hydra.job.env_set.HPCTK_API_PROBE=1", cwd=tmp_path)
    assert not list(tmp_path.iterdir()) and process_state() == before


def test_a_caller_inside_its_own_hydra_app_keeps_it(tmp_path, monkeypatch):
    """submit() composes with Hydra's compose API, whose global state is the caller's too: a
    notebook or a @hydra.main app that set Hydra up goes on composing after submit()."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from hpc import SubmitError, submit
    from hpc.config.compose import CONF_DIR, register_schemas
    from hpc.launching import local

    monkeypatch.setattr(local, "find_mpirun", lambda: None)  # refused after the composition and the run dir
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="callers"):
        before = compose("config", overrides=["optim.lr=0.3"])
        with pytest.raises(SubmitError, match=r"^mpirun not found"):
            submit("optim.lr=0.2", cwd=tmp_path)
        assert GlobalHydra.instance().is_initialized()
        after = compose("config", overrides=["optim.lr=0.3"])
        assert after.optim.lr == before.optim.lr == 0.3
