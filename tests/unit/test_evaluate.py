"""`python -m hpc.evaluate`: what it refuses, in one line each (the pipeline test on the
simulated cluster, tests/e2e/test_pipeline_slurm.py, evaluates a real run's checkpoint)."""

from __future__ import annotations

from dataclasses import replace

from hpc.config.compose import compose_job
from hpc.launching.launch import resolved_yaml
from hpc.tools.evaluate import main


def run_dir_of(tmp_path, **changes):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(resolved_yaml(replace(compose_job([]), **changes)))
    return run


def test_a_directory_that_is_no_run_dir_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path} is not a run dir (no config.yaml in it)\n"


def test_a_run_without_a_committed_checkpoint_is_one_line(tmp_path, capsys):
    run = run_dir_of(tmp_path)
    (run / "checkpoints").mkdir()
    assert main([str(run), "--split", "test"]) == 2
    assert capsys.readouterr().err == f"error: {run / 'checkpoints'} holds no committed checkpoint\n"


def test_a_scripts_run_is_left_to_the_script(tmp_path, capsys):
    run = run_dir_of(tmp_path, script="train.py")
    assert main([str(run)]) == 2
    assert capsys.readouterr().err == f"error: {run} ran a script (train.py): its model is the script's own; evaluate it there\n"
