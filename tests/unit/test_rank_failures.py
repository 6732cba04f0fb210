"""Which failures of a rank would repeat on a restart (the job ends) and which need not (counted
against the failure budget, as a killed rank is): hpc.rank.failures, and what abort_job does."""

from __future__ import annotations

import errno
import json
import logging
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collectives.base import CollectivesError
from hpc.env import REQUEST_DIR_VARIABLE, RankInfo
from hpc.errors import UserError
from hpc.rank import main as rank_main
from hpc.rank.failures import repeats
from hpc.rundir import RunDir
from hpc.slurm import job as lifecycle
from tests.support.runs import ROOT
from trainers.checkpoint.checkpointer import CheckpointError, store_failure
from trainers.checkpoint.storage import StoreError
from trainers.data.datasets import DataError
from trainers.data.loader import DataWorkerError
from trainers.guard import DivergedError
from trainers.task import TaskError

LASTING = [
    TaskError("task.hidden must be > 0"),
    CheckpointError("written by task lm, not classify"),
    store_failure("writing the checkpoint", StoreError("uploading step-000000010/shared.ckpt (s3://nobucket/p) failed: NoSuchBucket")),
    DivergedError("3 non-finite steps in a row"),
    DataError("labels outside 0..9"),
    UserError("comm=nccl needs GPUs"),
    CollectivesError("comm=nccl needs a GPU on every rank"),
    FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.h5"),
    PermissionError(errno.EACCES, "Permission denied", "/data/x.h5"),
    OSError("Unable to open file (unable to open file: No such file or directory)"),  # h5py without an errno
    TypeError("forward() takes 2 positional arguments but 3 were given"),
    AttributeError("'Tensor' object has no attribute 'sizee'"),
    type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB"),
    MemoryError(),
]
PASSING = [
    OSError(errno.EIO, "Input/output error"),
    OSError(errno.ESTALE, "Stale file handle"),
    OSError(
        "Unable to synchronously read data (file read failed: errno = 5, error message = 'Input/output error')"
    ),  # h5py's, no errno: only "No such file" repeats
    TimeoutError("Gloo: timed out waiting for peers"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    RuntimeError("NCCL watchdog: collective operation timeout"),
    DataWorkerError("data worker 1 died (killed by SIGKILL, often the out-of-memory killer)"),
    KeyError("python"),
    store_failure("writing the checkpoint", StoreError("uploading step-000000010/shared.ckpt (s3://b/p) failed after 5 attempts: ...", transient=True)),
]


@pytest.mark.parametrize("err", LASTING, ids=lambda e: type(e).__name__)
def test_the_users_deterministic_errors_repeat(err):
    assert repeats(err)


@pytest.mark.parametrize("err", PASSING, ids=lambda e: type(e).__name__)
def test_everything_else_need_not_repeat(err):
    assert not repeats(err)


class Aborted:
    code: int | None = None

    def abort(self, code: int = 1) -> None:
        self.code = code


@pytest.mark.parametrize("err", [TaskError("bad task"), OSError(errno.EIO, "Input/output error")], ids=["repeats", "need-not"])
def test_abort_job_ends_every_rank_and_forbids_restarts_only_for_errors_that_repeat(err, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(REQUEST_DIR_VARIABLE, str(tmp_path))  # as the batch script sets it: the step supervisor reads markers there
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    forbidden: list[bool] = []
    monkeypatch.setattr(lifecycle, "forbid_failure_requeue", lambda env: forbidden.append(True) or "77")  # scontrol, not run here
    monkeypatch.setattr(rank_main.logging, "shutdown", lambda: None)  # the test's log capture stays open
    comm = Aborted()
    with caplog.at_level(logging.INFO):
        rank_main.abort_job(err, comm, RankInfo(1, 1, 2, 2, 0, 1, ("node1",), "slurm"), RunDir(tmp_path / "run"))  # type: ignore[arg-type]
    assert comm.code == 1
    lasting = isinstance(err, TaskError)
    assert bool(forbidden) == lasting and bool(list(tmp_path.glob("77.error-*"))) == lasting
    assert ("need not repeat: counted as a failure, like a lost rank" in caplog.text) != lasting
    # A toolkit refusal is one line, the user's fix in it; anything else comes with its traceback
    # (issue 46: TaskError taken off the one-line list left every test passing).
    told = [r for r in caplog.records if "aborting all 2 ranks" in r.getMessage()]
    assert len(told) == 1 and (told[0].getMessage() == "error: bad task; aborting all 2 ranks") == lasting
    assert (told[0].exc_info is None) == lasting


def test_an_error_that_comes_back_the_same_at_the_same_step_after_a_restart_repeats(tmp_path, monkeypatch, caplog):
    """A task with 5 outputs and labels up to 9 fails at the same step with the same IndexError
    on every start: its first failure is counted as transient (IndexError is not on the list),
    the second, after a restart, is evidence: the job ends instead of spending its whole budget."""
    monkeypatch.setenv(REQUEST_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    forbidden: list[bool] = []
    monkeypatch.setattr(lifecycle, "forbid_failure_requeue", lambda env: forbidden.append(True) or "78")
    monkeypatch.setattr(rank_main.logging, "shutdown", lambda: None)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    rank = RankInfo(1, 1, 2, 2, 0, 1, ("node1",), "slurm")
    bug = IndexError("Target 7 is out of bounds.")

    def fail_at(step: int, err: BaseException) -> bool:
        run.steps.write_text(json.dumps({"step": step, "loss": 2.0}) + "\n")  # where rank 0 had got to
        forbidden.clear()
        started = time.time()
        monkeypatch.setattr(rank_main, "process_started", lambda: started)  # each failure a start of its own
        with caplog.at_level(logging.INFO):
            rank_main.abort_job(err, Aborted(), rank, run)  # type: ignore[arg-type]
        return bool(forbidden)

    assert not fail_at(12, bug)  # the first time: need not repeat
    assert not fail_at(30, IndexError("Target 7 is out of bounds."))  # the same error elsewhere: no evidence yet
    assert not fail_at(12, RuntimeError("NCCL watchdog: collective operation timeout"))  # another error at that step
    assert fail_at(12, IndexError("Target 7 is out of bounds."))  # the same error at the same step after a restart
    assert "the same IndexError at step 12 as before a restart: it repeats" in caplog.text
    assert len((run.path / "failures.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize(
    ("err", "lasting"),
    [(OSError(errno.EIO, "Input/output error"), False), (TypeError("forward() takes 2 positional arguments"), True), ("exit 2", True)],
    ids=["transient", "repeats", "own-exit"],
)
def test_a_scripts_error_ends_the_job_for_good_only_where_it_would_repeat(err, lasting, tmp_path, monkeypatch, caplog):
    """The script path sorts its failures as the task path does (issue 46: making every script
    exception permanent left every test passing): a transient one is counted and restarted."""
    from hpc.config.schema import JobConfig
    from hpc.rank import hosting
    from hpc.rank import script as script_module
    from trainers.preemption import StopFlag

    monkeypatch.setenv(REQUEST_DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "79")
    forbidden: list[bool] = []
    monkeypatch.setattr(lifecycle, "forbid_failure_requeue", lambda env: forbidden.append(True) or "79")
    monkeypatch.setattr(rank_main.logging, "shutdown", lambda: None)
    monkeypatch.setattr(hosting.Host, "of", staticmethod(lambda *args: None))  # the script's host: not needed to fail
    raised = script_module.ScriptFailed("the script exited with code 2") if err == "exit 2" else err

    def failing(*args):  # what run_script raises when the user's script does
        raise raised

    monkeypatch.setattr(script_module, "run_script", failing)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    job = JobConfig(script="train.py", workdir=str(tmp_path))
    rank = RankInfo(1, 1, 2, 2, 0, 1, ("node1",), "slurm")
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as exited:  # told in the log, not raised again on stderr
        rank_main.script_rank(job, run, rank, StopFlag())
    assert exited.value.code == 1
    assert str(raised) in caplog.text
    assert json.loads(run.result.read_text())["failed_rank"] == 1  # the failing rank says so itself
    assert bool(forbidden) == lasting and bool(list(tmp_path.glob("79.error-*"))) == lasting
    assert ("need not repeat: counted as a failure, like a lost rank" in caplog.text) != lasting


def raise_through(frames: list[tuple[str, str]], err: Exception) -> Exception:
    """`err` raised through nested functions, each compiled as if from file `path` (the toolkit's,
    a library's, the user's) and caught in the first, as a rank's traceback begins in
    hpc/rank/main.py. Returns the caught exception."""
    namespace: dict = {"err": err}
    for depth, (path, name) in enumerate(reversed(frames)):
        inner = "raise err" if depth == 0 else f"{frames[len(frames) - depth][1]}()"
        body = inner if depth < len(frames) - 1 else f"try:\n        {inner}\n    except Exception as caught:\n        return caught"
        exec(compile(f"def {name}():\n    {body}\n", path, "exec"), namespace)
    return namespace[frames[0][1]]()


def test_a_users_traceback_starts_at_the_users_own_frame(tmp_path):
    """Issue 46: a script's error came behind the toolkit's own frames (hpc/rank/main.py,
    script.py, runpy); the user's code and what it called stay."""
    import runpy
    import traceback

    from hpc.rank.failures import from_users_frame

    code = rank_main.CODE_ROOT
    library = str(Path(runpy.__file__))
    frames = [(str(code / "hpc/rank/main.py"), "train"), (library, "run_path"), (str(tmp_path / "train.py"), "main")]
    err = raise_through([*frames, (str(code / "trainers/handle.py"), "end_step")], ValueError("bad shard"))
    shown = [frame.filename for frame in traceback.extract_tb(from_users_frame(err, code))]
    assert shown == [str(tmp_path / "train.py"), str(code / "trainers/handle.py")]
    inside = raise_through([(str(code / "hpc/rank/main.py"), "train"), (library, "run_path")], KeyError("python"))
    assert len(traceback.extract_tb(from_users_frame(inside, code))) == 2  # no frame of the user's: all of it


def test_a_start_up_failure_leaves_a_failed_result_with_the_rank_and_the_error(tmp_path, monkeypatch, capsys):
    """Issue 46: a rank that failed before its loop (here: a config.yaml it cannot read, edited
    after the launch) wrote no result.json, and hpc.status said DIED."""
    from hpc.tools.status import run_status

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "SLURM_STEP_ID", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(rank_main.logging, "shutdown", lambda: None)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.config.write_text("trainer:\n  max_stepz: 3\n")
    with pytest.raises(SystemExit) as ended:
        rank_main.train_rank(str(run.path))
    assert ended.value.code == 1
    result = json.loads(run.result.read_text())
    assert (result["status"], result["failed_rank"], result["exit_code"]) == ("failed", 0, 1)
    assert "max_stepz" in result["error"] and "\n" not in result["error"]
    assert run_status(run, {}).state == "FAILED"
    assert "Traceback" not in capsys.readouterr().err  # a refusal: its one line


# A rank's entry point as srun and mpirun start it, then a crash in native code
CRASH_AFTER_THE_ENTRY_POINT = """
import ctypes, runpy, sys
sys.argv = ["hpc.rank.main", sys.argv[1]]
try:
    runpy.run_module("hpc.rank.main", run_name="__main__")
except SystemExit:
    pass  # not a run directory: main's own refusal; the process lives on with what the entry point installed
def users_native_call():
    ctypes.string_at(0)
users_native_call()
"""


def test_a_rank_that_crashes_in_native_code_prints_its_python_stack(tmp_path):
    """A segfault in a rank (seen in MPI's start-up, issue 46) showed only a libc frame: now
    every thread's Python stack is in the job's log, and the rank still dies of the signal."""
    crashed = subprocess.run([sys.executable, "-c", CRASH_AFTER_THE_ENTRY_POINT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert crashed.returncode == -signal.SIGSEGV, crashed.stderr
    assert "Fatal Python error: Segmentation fault" in crashed.stderr
    assert re.search(r'File "<string>", line \d+ in users_native_call', crashed.stderr), crashed.stderr


@pytest.mark.parametrize(("number", "lasting"), [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EROFS, True), (errno.EIO, False), (errno.ESTALE, False)])
def test_a_storage_failure_ends_a_slurm_job_for_good_only_where_it_stays(number, lasting, tmp_path, monkeypatch, caplog):
    """A full disk, a quota or a read-only file system would meet the job again: no restart in
    the allocation (the error marker), no requeue (Requeue cleared). EIO and ESTALE may pass:
    the job's failure budget restarts it. Either way the run's end is recorded, in one line."""
    from hpc.rank.diskfaults import end_on_storage_failure
    from trainers.faults import Fault, StorageFailure

    monkeypatch.setenv(REQUEST_DIR_VARIABLE, str(tmp_path / "requests"))
    monkeypatch.setenv("SLURM_JOB_ID", "81")
    forbidden: list[bool] = []
    monkeypatch.setattr(lifecycle, "forbid_failure_requeue", lambda env: forbidden.append(True) or "81")  # scontrol, not run here
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.config.write_text("{}\n")  # launch.py's job: hpc.resubmit submits it again
    fault = Fault(number, str(run.steps))
    with caplog.at_level(logging.INFO):
        ended = end_on_storage_failure(StorageFailure(fault.line(), 34, fault, rank=1), run, RankInfo(0, 0, 2, 2, 0, 1, ("node1",), "slurm"))
    assert bool(forbidden) == lasting and bool(list((tmp_path / "requests").glob("81.error-*"))) == lasting
    assert ended["recorded"] and run.read_result() == {k: v for k, v in ended.items() if k != "recorded"}
    assert ended["failed_rank"] == 1 and ended["exit_code"] == 1 and ended["told"]
    told = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert told == [f"error: {ended['error']}"] and ended["error"].endswith(f"then python -m hpc.resubmit {run.path}"), told


@pytest.mark.parametrize(
    ("env", "made_by_launch", "said"),
    [
        ({}, True, "bash {run}/command.txt"),
        ({}, False, "start the same command again (it resumes {run})"),
        ({"SLURM_JOB_ID": "7"}, True, "python -m hpc.resubmit {run}"),
        ({"SLURM_JOB_ID": "7"}, False, "submit your batch script again (it resumes {run})"),
    ],
)
def test_the_command_a_fault_line_names_resumes_the_run_the_way_it_was_started(tmp_path, env, made_by_launch, said):
    """launch.py's run dirs hold config.yaml (and command.txt, locally): hpc.resubmit or
    command.txt resume them; ranks started by hand (torchrun, mpirun, the user's own sbatch
    script) are resumed by starting them the same way."""
    from hpc.rank.scheduler import scheduler_of

    if made_by_launch:
        (tmp_path / "command.txt").write_text("python launch.py\n")
        (tmp_path / "config.yaml").write_text("{}\n")
    assert scheduler_of(env).resume_command(tmp_path) == said.format(run=tmp_path)


def test_the_same_error_of_the_same_failures_other_ranks_is_not_a_repeat(tmp_path):
    """The survivors of one lost peer fail alike at the same step (Gloo's `Connection reset by
    peer`): one failure, not a repeated one. The same error written before this rank started is."""
    from hpc.rank.failures import repeats_here

    (tmp_path / "steps.jsonl").write_text(json.dumps({"step": 10}) + "\n")
    peer_gone = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:38785: Connection reset by peer")
    started = time.time()
    assert repeats_here(tmp_path, peer_gone, rank=2, since=started) == (False, "")  # the first survivor
    assert repeats_here(tmp_path, peer_gone, rank=0, since=started) == (False, "")  # another, the same moment
    lasting, why = repeats_here(tmp_path, peer_gone, rank=0, since=time.time() + 1)  # a later start: the evidence counts
    assert lasting and "as before a restart: it repeats" in why
