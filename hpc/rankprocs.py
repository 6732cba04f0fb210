"""A local run's rank processes, found by the pids they recorded in RUN_DIR/heartbeats
(trainers.watchdog), each checked to be that rank still: `python -m hpc.stop` signals them, the
resume verifier (hpc.verify) stops and kills them. Login-node code: no torch."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from hpc.errors import UserError
from hpc.rundir import RunDir
from trainers.watchdog import Heartbeat, read_heartbeats

RANK_MODULE = "hpc.rank.main"  # what every rank runs: `python -m hpc.rank.main RUN_DIR` (hpc.launching.local, the sbatch script)
# A local run's ranks are forks of `python -u -m hpc.rank.warm RUN_DIR` (hpc.launching.ranks): a
# fork's command line is its warm process's, and it started when it was forked.
WARM_MODULE = "hpc.rank.warm"
# A process start time read from /proc is whole seconds of boot time plus clock ticks, and the
# wall clock may have been stepped since boot: a start this much after the heartbeat still counts.
CLOCK_SLACK_S = 2.0


def is_rank_of(argv: Sequence[str], started_at: float, beat: Heartbeat, run_dir: Path) -> bool:
    """Whether a process (its command line, when it started) is the rank of `run_dir` that wrote
    `beat`: `PYTHON [OPTIONS] -m hpc.rank.main RUN_DIR`, or a fork of the run's warm process
    (`... -m hpc.rank.warm RUN_DIR`; a launcher names either further along its own command line,
    after its own program and arguments: mpirun, srun, hpc.launching.ranks), started before the
    heartbeat was written (a process that took the pid of an ended rank started after its last one)."""
    if "-m" not in argv[:-2]:
        return False
    at = argv.index("-m")
    options_only = all(arg.startswith("-") for arg in argv[1:at])  # `python -u -m ...`; not `mpirun -n 2 python -m ...`
    same_run = Path(argv[at + 2]).resolve() == run_dir.resolve()  # the rank's is absolute; yours may be relative or by a link
    return options_only and argv[at + 1] in (RANK_MODULE, WARM_MODULE) and same_run and started_at <= beat.time + CLOCK_SLACK_S


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


def stop_signal(run_dir: RunDir) -> str:
    """cluster.signal from the run's config.yaml: the signal the job was submitted with."""
    import yaml

    try:
        config = yaml.safe_load(run_dir.config.read_text())
        name = config["cluster"]["signal"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return "USR1"
    return str(name) if str(name) in ("USR1", "USR2", "TERM", "INT") else "USR1"


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
        raise UserError(f"{run_dir.path} is not running{ended}: none of the pids its ranks recorded ({pids_of(here)}) is one of its ranks now")
    return live


def pids_of(beats: Sequence[Heartbeat]) -> str:
    return ", ".join(str(beat.pid) for beat in beats)


def _status(run_dir: RunDir) -> str | None:
    try:
        return json.loads(run_dir.result.read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
