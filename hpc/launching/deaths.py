"""A local run whose rank was killed (SIGKILL: mpirun's 137), told in one line by the launcher,
and recorded as the run's end (the rank could not).

    error: rank 1 (pid 4242) was killed by the kernel's out-of-memory killer: the run stopped at
    step 800; its newest committed checkpoint is step 780; give it more memory (or a smaller
    batch), then bash RUN/command.txt

The kernel log says whether the out-of-memory killer did it (`Killed process PID`, `oom-kill:
... pid=PID`) for the pids the ranks' heartbeats recorded; it is read where this user may
(`dmesg`: root, or kernel.dmesg_restrict=0). Where it may not, or says nothing, the line says
"killed (SIGKILL: out of memory?)": the OOM killer is the usual sender. On Slurm the job's own
state says it (OUT_OF_MEMORY, from its cgroup).
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess

from hpc.rundir import RunDir, last_record

KILLED = 128 + signal.SIGKILL  # mpirun's exit code when a rank died by SIGKILL


def kernel_log() -> str | None:
    """The kernel's ring buffer; None where this user may not read it."""
    try:
        read = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return read.stdout if read.returncode == 0 else None


def oom_killed(log: str, pids: dict[int, int]) -> tuple[int, int] | None:
    """(rank, pid) of the rank the kernel log says the OOM killer ended; None: none of them."""
    for line in reversed(log.splitlines()):
        found = re.search(r"(?:Killed process |oom-kill:.*\bpid=)(\d+)", line)
        if found and int(found.group(1)) in pids:
            return pids[int(found.group(1))], int(found.group(1))
    return None


def killed_line(run_dir: RunDir, log: str | None) -> tuple[str, dict[str, object]]:
    """The one line and the end to record, for a run one of whose ranks was SIGKILLed."""
    from trainers.checkpoint.storage import newest_committed_or_none
    from trainers.watchdog import read_heartbeats

    pids = {beat.pid: beat.rank for beat in read_heartbeats(run_dir.heartbeats)}
    found = oom_killed(log, pids) if log is not None else None
    if found is not None:
        who, reason, remedy = (
            f"rank {found[0]} (pid {found[1]}) was killed by the kernel's out-of-memory killer",
            "out of memory",
            "give it more memory (or a smaller batch)",
        )
    else:
        who, reason, remedy = "a rank was killed (SIGKILL: out of memory?)", "killed", "see the rank logs and the kernel log (dmesg)"
    step = (last_record(run_dir.steps) or {}).get("step")
    newest = newest_committed_or_none(run_dir.checkpoints)
    kept = f"its newest committed checkpoint is step {newest}" if newest is not None else "no checkpoint was committed"
    line = f"{who}: the run stopped at step {step if step is not None else 0}; {kept}; {remedy}, then bash {shlex.quote(str(run_dir.path / 'command.txt'))}"
    end: dict[str, object] = {"status": "failed", "finished": False, "exit_code": KILLED, "reason": reason, "error": line, "told": True}
    if found is not None:
        end["failed_rank"] = found[0]
    return line, end


def tell_killed(run_dir: RunDir) -> str:
    """The line for a run whose rank was SIGKILLed, its end recorded (hpc.status: FAILED, why)."""
    line, end = killed_line(run_dir, kernel_log())
    run_dir.write_result(end)
    return line
