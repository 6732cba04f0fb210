"""The agreed stop, asked for by hand: every rank stops at the same step and saves.

    python -m hpc.stop RUN_DIR

A local run (cluster=local): the run's stop signal (cluster.signal, SIGUSR1 by default) goes to
its rank processes, found by the pids the ranks recorded in RUN_DIR/heartbeats (trainers.watchdog)
and each checked first to be that rank still: its command line is `python -m hpc.rank.main
RUN_DIR` and it started before it wrote its heartbeat. Never the launcher or mpirun (their
command lines name the run dir too), nor a process that took the pid of a rank that ended. The
ranks exit with code 75 and `bash RUN_DIR/command.txt` resumes the run.

A Slurm job: `scancel --signal=USR1 JOB`, which signals the tasks of every step, as a preemption
does (not the batch shell: its EXIT trap requeues the job). Rank 0 asks for the requeue, and the
job resumes by itself from the checkpoint.

One line says what was sent. A directory that is no run dir, a run that is not running and a
run whose ranks recorded no pid are one line each, with exit code 2. Login-node code: no torch.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpc import slurmctl
from hpc.errors import UserError
from hpc.rundir import RunDir
from trainers.watchdog import Heartbeat, read_heartbeats

RANK_MODULE = "hpc.rank.main"  # what every rank runs: `python -m hpc.rank.main RUN_DIR` (hpc.submit.local, the sbatch script)
# A process start time read from /proc is whole seconds of boot time plus clock ticks, and the
# wall clock may have been stepped since boot: a start this much after the heartbeat still counts.
CLOCK_SLACK_S = 2.0


def is_rank_of(argv: Sequence[str], started_at: float, beat: Heartbeat, run_dir: Path) -> bool:
    """Whether a process (its command line, when it started) is the rank of `run_dir` that wrote
    `beat`: `PYTHON [OPTIONS] -m hpc.rank.main RUN_DIR` (a launcher names that further along its
    own command line, after its own program and arguments: mpirun, srun, hpc.submit.ranks), started
    before the heartbeat was written (a process that took the pid of an ended rank started after
    its last one)."""
    if "-m" not in argv[:-2]:
        return False
    at = argv.index("-m")
    options_only = all(arg.startswith("-") for arg in argv[1:at])  # `python -u -m ...`; not `mpirun -n 2 python -m ...`
    same_run = Path(argv[at + 2]).resolve() == run_dir.resolve()  # the rank's is absolute; yours may be relative or by a link
    return options_only and argv[at + 1] == RANK_MODULE and same_run and started_at <= beat.time + CLOCK_SLACK_S


def process_facts(pid: int) -> tuple[list[str], float] | None:
    """The command line of process `pid` and when it started (seconds since the epoch); None
    when there is no such process (or no /proc to read it in)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return [arg.decode(errors="replace") for arg in argv if arg], boot + ticks / os.sysconf("SC_CLK_TCK")


def read_run(path: Path) -> tuple[RunDir, dict[str, Any]]:
    """The run dir at `path` and its job.json; UserError naming what `path` is instead."""
    run_dir = RunDir(path.resolve())
    if not path.is_dir():
        raise UserError(f"{path}: no such directory; name the run directory launch.py printed")
    if (path / "sweep.json").is_file():
        raise UserError(f"{path} is a sweep directory; name one of its points ({path / '0'}, ...)")
    if not run_dir.config.is_file():
        raise UserError(f"{path} is not a run directory (no config.yaml); name the run directory launch.py printed")
    try:
        job = json.loads(run_dir.job.read_text())
    except (OSError, ValueError):
        why = "launch.py did not start this run; a hand-typed sbatch script's job stops with scancel --signal=USR1 JOB_ID"
        raise UserError(f"{path}: no job.json ({why})") from None
    return run_dir, job if isinstance(job, dict) else {}


def stop_signal(run_dir: RunDir) -> str:
    """cluster.signal from the run's config.yaml: the signal the job was submitted with."""
    import yaml

    try:
        config = yaml.safe_load(run_dir.config.read_text())
        name = config["cluster"]["signal"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return "USR1"
    return str(name) if str(name) in ("USR1", "USR2", "TERM", "INT") else "USR1"


def stop_slurm_job(job_id: str, name: str) -> str:
    """The stop to every rank of Slurm job `job_id` through scancel, when it runs."""
    if not slurmctl.available("squeue"):
        raise UserError(f"job {job_id} is a Slurm job and squeue is not here; run python -m hpc.stop on the cluster's login node")
    state = slurmctl.job_state(job_id)
    if state != "RUNNING":
        hint = f" (scancel {job_id} cancels it)" if state in slurmctl.WAITING_STATES else ""
        raise UserError(f"job {job_id} is not running ({state}): no rank to stop{hint}")
    error = slurmctl.cancel(job_id, signal=name)
    if error is not None:
        raise UserError(f"scancel --signal={name} {job_id}: {error}")
    return f"sent SIG{name} to every rank of job {job_id} (scancel --signal={name} {job_id}): they stop at the same step and save, and the job is requeued"


def live_ranks(run_dir: RunDir, host: str) -> list[Heartbeat]:
    """The ranks of a local run that run now: each recorded pid whose process is still that rank.
    UserError when the ranks recorded no pid, ran on another host, or none runs any more."""
    beats = read_heartbeats(run_dir.heartbeats)
    if not beats:
        raise UserError(
            f"{run_dir.path}: no rank recorded its pid in heartbeats/ (the ranks are starting, a script without the run handle, "
            "or trainer.watchdog_s=null); stop it with Ctrl-C where launch.py runs"
        )
    here = [beat for beat in beats if beat.host == host]
    if not here:
        raise UserError(f"{run_dir.path}: its ranks ran on {beats[0].host}, not here ({host}); run python -m hpc.stop there")
    live = []
    for beat in sorted(here, key=lambda b: b.rank):
        found = process_facts(beat.pid)
        if found is not None and is_rank_of(found[0], found[1], beat, run_dir.path):
            live.append(beat)
    if not live:
        ended = {"completed": " (it completed)", "stopped": " (it stopped)"}.get(_status(run_dir) or "", "")
        raise UserError(f"{run_dir.path} is not running{ended}: none of the pids its ranks recorded ({_pids(here)}) is one of its ranks now")
    return live


def stop_local_ranks(run_dir: RunDir, name: str, host: str) -> str:
    """The stop signal to each rank of a local run that runs now."""
    sent = []
    for beat in live_ranks(run_dir, host):
        try:
            os.kill(beat.pid, signal.Signals[f"SIG{name}"])
        except ProcessLookupError:
            continue  # ended since it was checked
        except PermissionError:
            raise UserError(f"not allowed to signal pid {beat.pid}, rank {beat.rank} of {run_dir.path} (another user's run?)") from None
        sent.append(beat)
    if not sent:
        raise UserError(f"{run_dir.path} is not running: its ranks ended just now")
    ranks = f"{len(sent)} rank{'' if len(sent) == 1 else 's'}"
    return f"sent SIG{name} to {ranks} of {run_dir.path} (pids {_pids(sent)}): they stop at the same step and save; bash {run_dir.path / 'command.txt'} resumes"


def stop_run(path: Path, host: str | None = None) -> str:
    """The agreed stop for the run at `path`, local or on Slurm; the line saying what was sent."""
    run_dir, job = read_run(path)
    name = stop_signal(run_dir)
    job_id = job.get("job_id")
    if isinstance(job_id, str) and job_id:
        return stop_slurm_job(job_id, name)
    return stop_local_ranks(run_dir, name, host or socket.gethostname())


def _pids(beats: Sequence[Heartbeat]) -> str:
    return ", ".join(str(beat.pid) for beat in beats)


def _status(run_dir: RunDir) -> str | None:
    try:
        return json.loads(run_dir.result.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv: list[str]) -> int:
    from hpc.cli import Parser

    parser = Parser("python -m hpc.stop", __doc__ or "")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory launch.py printed")
    args = parser.parse_args(argv)
    try:
        print(stop_run(Path(args.run_dir)))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
