"""`python -m hpc.stop RUN_DIR` (hpc.tools.stop): the stop signal reaches a local run's own rank
processes, by the pids they recorded, and nothing else; a Slurm job gets it through scancel; a
run that is not running, or no run at all, is one line and exit code 2. Tests/mpi/test_stop.py
stops a real run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from collectives.mpirun import mpirun_command
from hpc.errors import UserError
from hpc.slurm import slurmctl
from hpc.tools import stop
from hpc.tools.stop import is_rank_of, main, process_facts, stop_run
from trainers.watchdog import Heartbeat, heartbeat_file

RUN = Path("/runs/2026-11-27/10-00-00-000000_train")
BEAT = Heartbeat(rank=0, step=12, host="here", pid=4242, time=1000.0)
PY = sys.executable


@pytest.mark.parametrize(
    ("argv", "started_at", "rank"),
    [
        ([PY, "-m", "hpc.rank.main", str(RUN)], 900.0, True),
        (["python3", "-u", "-m", "hpc.rank.main", str(RUN)], 900.0, True),  # interpreter options first
        ([PY, "-m", "hpc.rank.main", str(RUN)], 1001.5, True),  # within the clock's slack
        ([PY, "-m", "hpc.rank.main", str(RUN)], 1010.0, False),  # started after the heartbeat: a pid taken anew
        ([PY, "-m", "hpc.rank.main", "/runs/other"], 900.0, False),
        ([PY, "-u", "-m", "hpc.rank.warm", str(RUN)], 900.0, True),  # a fork of the run's warm process (hpc.launching.ranks)
        ([PY, "-u", "-m", "hpc.rank.warm", "/runs/other"], 900.0, False),  # another run's
        ([PY, "-m", "hpc.launching.ranks", "--warm", str(RUN), "mpirun", "-n", "2", PY, "-m", "hpc.rank.main", str(RUN)], 900.0, False),
        ([PY, "-m", "hpc.launching.ranks", str(RUN), "mpirun", "-n", "2", PY, "-m", "hpc.rank.main", str(RUN)], 900.0, False),  # the launcher
        (mpirun_command(2, [PY, "-m", "hpc.rank.main", str(RUN)], mpirun="/usr/bin/mpirun"), 900.0, False),  # what launch.py runs
        ([PY, "-c", "pass", "-m", "hpc.rank.main", str(RUN)], 900.0, False),
        (["srun", "--mpi=pmix", "python3", "-m", "hpc.rank.main", str(RUN)], 900.0, False),
        (["sleep", "60"], 900.0, False),
        ([], 900.0, False),  # a zombie's empty command line
    ],
)
def test_only_the_rank_itself_is_that_rank(argv, started_at, rank):
    assert is_rank_of(argv, started_at, BEAT, RUN) is rank


def run_dir_at(root: Path, signal_name: str = "USR1", **job: object) -> Path:
    run_dir = root / "runs" / "2026-11-27" / "10-00-00-000000_train"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"name: train\ncluster:\n  name: local\n  signal: {signal_name}\n")
    (run_dir / "job.json").write_text(json.dumps(job or {"launcher": "local", "pid": 1, "host": "here"}))
    return run_dir


def record(run_dir: Path, rank: int, pid: int, host: str = "here", at: float | None = None) -> None:
    beats = run_dir / "heartbeats"
    beats.mkdir(exist_ok=True)
    heartbeat_file(beats, rank).write_text(json.dumps({"rank": rank, "step": 7, "host": host, "pid": pid, "time": time.time() if at is None else at}))


FAKE_RANK = """import os, signal, sys, time
from pathlib import Path
run_dir = Path(sys.argv[1])
def stop(signum, frame):
    (run_dir / f"got-{os.getpid()}").write_text(signal.Signals(signum).name)
    sys.exit(0)
for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
    signal.signal(sig, stop)
(run_dir / f"ready-{os.getpid()}").touch()
time.sleep(60)
"""


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; each one it leaves is killed, by its own pid."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def started(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """`proc` once its command line shows in /proc (right after the fork it is still empty)."""
    deadline = time.monotonic() + 30
    while not (process_facts(proc.pid) or ([], 0.0))[0]:
        assert time.monotonic() < deadline, "the process did not start"
        time.sleep(0.01)  # there is no event to wait on
    return proc


def fake_rank(tmp_path: Path, run_dir: Path, processes: list[subprocess.Popen[bytes]]) -> int:
    """A process whose command line is a rank's (`python -m hpc.rank.main RUN_DIR`), running a
    stand-in hpc/rank/main.py that notes the signal it gets."""
    fake = tmp_path / "fake"
    (fake / "hpc" / "rank").mkdir(parents=True, exist_ok=True)
    for name in ("hpc/__init__.py", "hpc/rank/__init__.py"):
        (fake / name).write_text("")
    (fake / "hpc" / "rank" / "main.py").write_text(FAKE_RANK)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONSAFEPATH"} | {"PYTHONPATH": str(fake)}
    proc = subprocess.Popen([PY, "-m", "hpc.rank.main", str(run_dir)], cwd=fake, env=env)
    processes.append(proc)
    deadline = time.monotonic() + 30
    while not (run_dir / f"ready-{proc.pid}").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the stand-in rank did not start"
        time.sleep(0.01)  # waiting for its handlers: there is no event to wait on
    return proc.pid


def test_a_local_runs_ranks_get_its_stop_signal_and_nothing_else_does(tmp_path, processes):
    run_dir = run_dir_at(tmp_path, signal_name="USR2")  # cluster.signal: what the job was started with
    ranks = [fake_rank(tmp_path, run_dir, processes) for _ in range(2)]
    others = [subprocess.Popen(["sleep", "60"]), subprocess.Popen([PY, "-c", "import time; time.sleep(60)", "-m", "hpc.rank.main", str(run_dir)])]
    processes.extend(others)
    for proc in others:
        started(proc)
    for rank, pid in enumerate(ranks):
        record(run_dir, rank, pid)
    record(run_dir, 2, others[0].pid)  # a pid a rank recorded, taken by another process since
    record(run_dir, 3, others[1].pid)  # a launcher's command line names the rank entry point too
    started_late = fake_rank(tmp_path, run_dir, processes)
    record(run_dir, 4, started_late, at=time.time() - 60)  # the recorded rank ended; another rank of the run took its pid later

    line = stop_run(run_dir, host="here")

    said = f"sent SIGUSR2 to 2 ranks of {run_dir} (pids {ranks[0]}, {ranks[1]})"
    assert line == f"{said}: they stop at the same step and save; bash {run_dir}/command.txt resumes"
    for pid in ranks:
        assert processes[[p.pid for p in processes].index(pid)].wait(timeout=30) == 0
        assert (run_dir / f"got-{pid}").read_text() == "SIGUSR2"
    assert all(proc.poll() is None for proc in [*others, processes[-1]])  # never signalled
    assert not (run_dir / f"got-{started_late}").exists()


def test_the_command_line_and_start_of_a_process_are_read_from_proc(processes):
    before = time.time()
    proc = started(subprocess.Popen(["sleep", "60"]))
    processes.append(proc)
    facts = process_facts(proc.pid)
    assert facts is not None and facts[0] == ["sleep", "60"] and before - 2 <= facts[1] <= time.time() + 2
    proc.kill()
    proc.wait()
    assert process_facts(proc.pid) is None


def test_a_run_that_is_not_running_or_no_run_is_one_line(tmp_path, processes):
    ended = subprocess.Popen(["true"])
    ended.wait()
    refusals = {}
    run_dir = run_dir_at(tmp_path / "a")
    refusals["no pids"] = run_dir
    run_dir = run_dir_at(tmp_path / "b")
    record(run_dir, 0, ended.pid)
    record(run_dir, 1, ended.pid)
    (run_dir / "result.json").write_text(json.dumps({"status": "stopped"}))
    refusals["ended"] = run_dir
    run_dir = run_dir_at(tmp_path / "c")
    record(run_dir, 0, os.getpid(), host="node7")
    refusals["elsewhere"] = run_dir
    (tmp_path / "d").mkdir()
    refusals["no config"] = tmp_path / "d"
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "sweep.json").write_text("{}")
    refusals["sweep"] = tmp_path / "e"
    run_dir = run_dir_at(tmp_path / "f")
    (run_dir / "job.json").unlink()
    refusals["no job.json"] = run_dir
    refusals["missing"] = tmp_path / "nowhere"
    expected = {
        "no pids": "no rank recorded its pid in heartbeats/",
        "ended": f"is not running (it stopped): none of the pids its ranks recorded ({ended.pid}, {ended.pid}) is one of its ranks now",
        "elsewhere": "its ranks ran on node7, not here (here); run python -m hpc.stop there",
        "no config": "is not a run directory (no config.yaml); name the run directory launch.py printed",
        "sweep": "is a sweep directory; name one of its points",
        "no job.json": "no job.json (launch.py did not start this run",
        "missing": "no such directory",
    }
    for what, path in refusals.items():
        with pytest.raises(UserError, match=re.escape(expected[what])):
            stop_run(path, host="here")


def test_the_command_says_it_in_one_line_with_exit_code_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {tmp_path} is not a run directory (no config.yaml); name the run directory launch.py printed\n"


def test_a_slurm_job_is_stopped_through_scancel_while_it_runs(tmp_path, monkeypatch):
    run_dir = run_dir_at(tmp_path, job_id="12_3", cluster="simulated")
    sent: list[tuple[str, str | None]] = []
    state = {"now": "RUNNING"}
    monkeypatch.setattr(stop.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(slurmctl, "job_records", lambda ids: {job_id: {"JobState": state["now"]} for job_id in ids})
    monkeypatch.setattr(slurmctl, "cancel", lambda job_id, signal=None: sent.append((job_id, signal)))
    line = stop_run(run_dir)
    assert sent == [("12_3", "USR1")]  # every step's tasks, not the batch shell: no --batch, no --full
    assert line == "sent SIGUSR1 to every rank of job 12_3 (scancel --signal=USR1 12_3): they stop at the same step and save, and the job is requeued"
    state["now"] = "PENDING"
    with pytest.raises(UserError, match=r"^job 12_3 is not running \(PENDING\): no rank to stop \(scancel 12_3 cancels it\)$"):
        stop_run(run_dir)
    for ended in ("COMPLETED", "COMPLETING"):  # COMPLETING: its ranks are ending already
        state["now"] = ended
        with pytest.raises(UserError, match=rf"^job 12_3 is not running \({ended}\): no rank to stop$"):
            stop_run(run_dir)
    monkeypatch.setattr(slurmctl, "job_records", lambda ids: {})
    monkeypatch.setattr(slurmctl, "accounting_states", lambda ids: {})
    with pytest.raises(UserError, match=r"^job 12_3 is not running: Slurm no longer knows it$"):
        stop_run(run_dir)
    run_dir.joinpath("job.json").write_text(json.dumps({"job_id": "12_3", "launcher": "sbatch"}))  # a hand-typed sbatch job's, before 2026-12-03
    state["now"] = "RUNNING"
    monkeypatch.setattr(slurmctl, "job_records", lambda ids: {job_id: {"JobState": state["now"]} for job_id in ids})
    assert stop_run(run_dir).startswith("sent SIGUSR1 to every rank of job 12_3")
    assert len(sent) == 2
    monkeypatch.setattr(stop.shutil, "which", lambda tool: None)
    with pytest.raises(UserError, match=r"^job 12_3 is a Slurm job and scontrol is not here; run python -m hpc.stop on the cluster's login node$"):
        stop_run(run_dir)
