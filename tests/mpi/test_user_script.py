"""A user's own torchrun-style script, unchanged, through launch.py (`script=train.py -- ARGS`):
on two local ranks it gets torchrun's environment and ends with the weights torchrun itself
gives it; its arguments arrive as typed; a stop ends it resumable; its own exit codes count."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.runs import ROOT, run_dirs

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "ddp" / "train.py"
# Arguments Hydra or OmegaConf would read as their own (a sweep's comma, an interpolation, quotes,
# an override's `=`) must reach the script exactly as typed.
TRICKY = ["a b", "${HOME}", "\\${x}", "x=1,2", 'it\'s "quoted"', "+key=value", "-m", "--cfg"]


def launch_script(work: Path, *overrides: str, script_args: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "launch.py"), f"script={SCRIPT}", f"run_root={work / 'runs'}", *overrides, "--", *script_args]


def ranks_report(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(world)]


def test_a_torchrun_script_runs_unchanged_on_two_ranks_as_torchrun_runs_it(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    args = ["--steps", "20", "--out", str(tmp_path / "ours"), "--keep-group", "--", *TRICKY]
    done = subprocess.run(launch_script(work, "resources.tasks_per_node=2", script_args=args), cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ours = ranks_report(tmp_path / "ours", 2)
    (run_dir,) = run_dirs(work)
    for rank, seen in enumerate(ours):
        assert seen["argv"] == args and seen["extra"] == TRICKY  # verbatim, through config.yaml and back
        assert seen["rank"] == rank and seen["world"] == 2
        assert seen["env"]["LOCAL_RANK"] == str(rank) and seen["env"]["LOCAL_WORLD_SIZE"] == "2" and seen["env"]["WORLD_SIZE"] == "2"
        assert seen["cwd"] == str(work)  # where launch.py ran, as torchrun's processes start
        # one write per line: under mpirun each write is forwarded alone, and two ranks' lines were spliced
        assert seen["stdout"] == {"line_buffering": True, "write_through": False}
        assert Path(seen["file"]) == run_dir / "code" / "script" / "train.py"  # the frozen copy
    assert (run_dir / "code" / "script" / "model.py").is_file()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["finished"] is True and result["world_size"] == 2
    assert (run_dir / "logs" / "rank-00001.log").is_file()
    # the script left its process group started: the rank destroyed it before the interpreter's
    # exit, where Gloo's threads letting go of the script's tensors can abort the process
    assert [json.loads((tmp_path / "ours" / f"exit-{rank}.json").read_text()) for rank in range(2)] == [{"group_left": False}] * 2

    # torchrun itself, on the same script and arguments: the same final weights, bit for bit
    theirs_args = ["--steps", "20", "--out", str(tmp_path / "theirs")]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *theirs_args]
    reference = subprocess.run(torchrun, cwd=work, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]
    theirs = ranks_report(tmp_path / "theirs", 2)
    assert [r["weights"] for r in ours] == [r["weights"] for r in theirs]
    # launch.py's output went to a pipe: the script's stdout says it is no terminal, as under torchrun (mpirun gives ranks a pty)
    assert [r["terminal"]["isatty"] for r in ours] == [r["terminal"]["isatty"] for r in theirs] == [False, False]
    set_by = {name for name, value in theirs[0]["env"].items() if value is not None}
    assert {name for name, value in ours[0]["env"].items() if value is not None} == set_by  # every variable torchrun sets, and no PYTHONSAFEPATH
    assert ours[0]["weights"] == ours[1]["weights"]  # DDP kept the ranks in step


def test_a_stop_ends_the_script_resumable_and_its_own_exit_codes_count(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "out"
    # Ctrl-C (SIGINT to launch.py, passed on to every rank) in the middle of a slow run
    proc = subprocess.Popen(
        launch_script(work, "resources.tasks_per_node=2", script_args=["--steps", "10000", "--step-seconds", "0.05", "--out", str(out)]),
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not all((out / f"progress-{rank}.txt").exists() for rank in range(2)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)  # polling the script's progress files: there is no event to wait on
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stdout[-2000:] + stderr[-2000:]
    (run_dir,) = run_dirs(work)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "stopped" and result["stopped_by"] == "SIGINT" and result["finished"] is False
    assert "stopped by SIGINT, the script keeps what it saved; not a Slurm job" in stdout
    assert "stopped; to start the script again (it resumes from what it saved itself): bash" in stdout and "committed checkpoint" not in stdout
    assert not (out / "rank-0.json").exists()  # it never reached its end
    assert all((out / f"interrupted-{rank}.txt").is_file() for rank in range(2))  # its own `except KeyboardInterrupt` ran, as under torchrun

    # Its own exit code 75 is a stop too (requeued on Slurm); any other non-zero one a failure
    def one_rank(exit_code: int) -> subprocess.CompletedProcess[str]:
        command = launch_script(tmp_path, "resources.tasks_per_node=1", script_args=["--steps", "2", "--out", str(out), "--exit-code", str(exit_code)])
        return subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300)

    resumable = one_rank(75)
    assert resumable.returncode == 75, resumable.stderr[-2000:]
    assert "stopped by the script's exit code 75 (resumable)" in resumable.stdout
    failed = one_rank(3)
    assert failed.returncode not in (0, 75)
    assert "error: the script exited with 3; ending all 1 ranks" in failed.stdout + failed.stderr


@pytest.mark.parametrize("fail_rank", ["1", "all"])
def test_a_script_that_fails_on_any_rank_is_a_failed_run_that_says_where_and_why(tmp_path, fail_rank):
    """Issue 46: rank 1 raising while rank 0 returned left result.json "completed" (a sweep
    counted it a success); now the run failed, on which rank, with the error, in result.json and
    in hpc.status."""
    from hpc.rundir import RunDir
    from hpc.tools.status import run_status

    script = ROOT / "tests" / "fixtures" / "scripts" / "fails" / "train.py"
    command = [sys.executable, str(ROOT / "launch.py"), f"script={script}", f"run_root={tmp_path / 'runs'}", "resources.tasks_per_node=2", "--"]
    done = subprocess.run([*command, "--fail-rank", fail_rank], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode not in (0, 75), done.stdout[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    failed = result["failed_rank"]
    assert (result["status"], result["finished"], result["exit_code"]) == ("failed", False, 1) and failed in ((1,) if fail_rank == "1" else (0, 1))
    assert result["error"] == f"ValueError: rank {failed} cannot read its shard"
    status = run_status(RunDir(run_dir), {})
    assert status.state == "FAILED" and f"(failed on rank {failed}: ValueError: rank {failed} cannot read its shard)" in status.line()
    # The launching terminal names the rank and the error, rank 1's included (its log is a file)
    assert f"error: the run failed on rank {failed}: ValueError: rank {failed} cannot read its shard" in done.stderr, done.stderr[-2000:]
    # and the traceback starts in the user's script (its frozen copy), not in the toolkit's frames that called it
    log = (run_dir / "logs" / f"rank-{failed:05d}.log").read_text()
    shown = log[log.index("Traceback (most recent call last):") :].splitlines()
    assert (
        shown[1].strip().startswith("File") and '/script/train.py", line' in shown[1] and not any("/hpc/rank/" in line or "runpy" in line for line in shown)
    ), log[-2000:]


def test_a_rank_ended_by_the_launcher_after_a_peers_own_exit_code_is_no_stop(tmp_path):
    """Rank 1 exits with its own code 3 while rank 0 still runs: mpirun ends rank 0 (SIGTERM),
    which must not turn the run into a stop to resume (result.json said "stopped", exit 75)."""
    script = ROOT / "tests" / "fixtures" / "scripts" / "fails" / "train.py"
    command = [sys.executable, str(ROOT / "launch.py"), f"script={script}", f"run_root={tmp_path / 'runs'}", "resources.tasks_per_node=2", "--"]
    done = subprocess.run([*command, "--exit-code", "3", "--others-wait", "120"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode not in (0, 75), done.stdout[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["failed_rank"], result["error"]) == ("failed", 1, "ScriptFailed: the script exited with 3"), result
    assert "error: the run failed on rank 1: ScriptFailed: the script exited with 3" in done.stderr, done.stderr[-2000:]


# A script file of the launch dir that reads a sibling config by relative path (as nanoGPT's
# `exec(open('configurator.py').read())` does), stops once (exit 75) and writes where it starts.
READS_ITS_CONFIG = """\
import os
import sys

run_dir = os.environ["HPCTK_RUN_DIR"]
value = open("settings.yaml").read().strip()
with open(os.path.join(run_dir, "seen.txt"), "a") as seen:
    seen.write(value + "\\n")
os.makedirs("out", exist_ok=True)
open(os.path.join("out", "made.txt"), "w").write(value)
if not os.path.exists(os.path.join(run_dir, "stopped-once")):
    open(os.path.join(run_dir, "stopped-once"), "w").close()
    sys.exit(75)
"""


def test_a_script_in_the_launch_dir_reads_its_sibling_files_from_the_frozen_copy_after_a_resume(tmp_path):
    """By default the ranks of a script file of the launch dir start in its frozen copy: the
    settings.yaml it opens by relative path is the one frozen at launch, even after the live one
    changed, and a folder it makes is the run's own (`workdir=`: tests/unit/test_scripts.py)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(READS_ITS_CONFIG)
    (work / "settings.yaml").write_text("v1\n")
    command = [sys.executable, str(ROOT / "launch.py"), "script=train.py", "resources.tasks_per_node=1"]
    first = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=300)
    assert first.returncode == 75, first.stdout[-2000:] + first.stderr[-2000:]
    (run_dir,) = run_dirs(work)
    (work / "settings.yaml").write_text("v2\n")  # edited while the run waits to resume
    resumed = subprocess.run(["bash", str(run_dir / "command.txt")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert (run_dir / "seen.txt").read_text() == "v1\nv1\n"
    assert (run_dir / "code" / "script" / "out" / "made.txt").is_file() and not (work / "out").exists()
