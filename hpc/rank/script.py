"""A user's own script on this rank (`script=`, hpc.config.scripts), in the rank's process: the
binding, the per-rank log and the stop signals the rank set up hold for the script too.

The script sees what torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR, MASTER_PORT: `init_process_group("gloo"|"nccl")` with env:// meets
the other ranks), its own arguments in sys.argv, its directory first on the import path, and
the working directory launch.py ran in. A file runs from the copy frozen with the job.

A stop signal (preemption, the time limit, Ctrl-C, scancel's SIGTERM) ends the script: it is
raised in the script's main thread as ScriptStopped, so `finally` blocks and context managers run,
and the job is requeued as a stopped training is (or, outside Slurm, the rank exits 75 for
whoever starts the run dir again). What the script saved before is what it resumes from. A
script that exits with code 75 itself (EXIT_RESUMABLE) is requeued the same way.
"""

from __future__ import annotations

import io
import logging
import os
import runpy
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hpc.config.scripts import SCRIPT_DIR, Script, parse_script
from hpc.env import RUN_DIR_VARIABLE, STEP_ATTEMPT_VARIABLE, TTY_VARIABLE, RankInfo, job_id, rendezvous, restart_count
from hpc.rank.hosting import Host, hosted
from hpc.rank.lifecycle import EXIT_RESUMABLE

if TYPE_CHECKING:
    from trainers.handle import Handle

log = logging.getLogger("hpc.rank")


class ScriptStopped(BaseException):
    """A stop signal, raised in the script's main thread (a BaseException: a script's `except
    Exception` does not swallow it)."""


class ScriptInterrupted(ScriptStopped, KeyboardInterrupt):
    """Ctrl-C's stop: a script's own `except KeyboardInterrupt:` (a save, a tidy exit) runs as
    it does under torchrun; the run stops all the same."""


class ScriptFailed(Exception):
    """The script ended with a non-zero exit code of its own (not 75): its own decision, so
    it ends the job instead of restarting it."""


@dataclass
class ScriptResult:
    """How the script ended, in result.json: `stopped_by` the signal (or "exit code 75"); the
    figures of its run handle (hpc.run), if it started one."""

    script: str
    stopped_by: str | None = None
    steps: int = 0  # counted by the run handle; 0 without one
    resumed_from: int | None = None
    loss: float | None = None  # the last step's, mean over ranks
    val_metrics: dict[str, float] = field(default_factory=dict)  # the newest val_<name> the script logged or passed to end_step()
    handle: bool = False  # the script used the run handle
    trackers: dict[str, str] = field(default_factory=dict)  # each tracker's state at the end (the run handle's)


def with_handle_figures(result: ScriptResult, handle: Handle | None) -> ScriptResult:
    """The run handle's view of how the script ended: a stop it agreed on is a stop, whether
    the script then returned or exited with 75."""
    if handle is None:
        return result
    if not handle.finished and not handle.stopped_by:
        log.warning("the script returned without run.finish(): steps after the newest checkpoint are not saved (call run.finish() after the loop)")
    result.handle, result.steps, result.resumed_from = True, handle.step, handle.resumed_from
    result.loss = handle.last.get("loss")
    result.trackers = dict(handle.reporter.trackers)
    validation = {**handle.validation, **{name: value for name, value in handle.logged.items() if name.startswith("val_")}}
    result.val_metrics = {name.removeprefix("val_"): value for name, value in validation.items()}
    if handle.stopped_by:
        result.stopped_by = handle.stopped_by
    return result


def torchrun_environment(rank: RankInfo, meet: tuple[str, int] | None, run_id: str, restarts: int) -> dict[str, str]:
    """The variables torchrun's agent gives each process (torch.distributed.elastic's
    local_elastic_agent), so a script that reads any of them finds it. `run_id`: the job's (or the
    run dir's) name; `restarts`: how often this job was started again (requeues and restarts in
    the allocation). No agent store: rank 0's process group starts its own, as under MPI."""
    env = {
        "RANK": str(rank.rank),
        "WORLD_SIZE": str(rank.world_size),
        "LOCAL_RANK": str(rank.local_rank),
        "LOCAL_WORLD_SIZE": str(rank.local_world_size),
        "GROUP_RANK": str(rank.node_rank),
        "GROUP_WORLD_SIZE": str(rank.num_nodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank.rank),
        "ROLE_WORLD_SIZE": str(rank.world_size),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
        "TORCHELASTIC_MAX_RESTARTS": "0",  # torchrun's default; the toolkit's restarts are requeues
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
    if meet is not None:
        env["MASTER_ADDR"], env["MASTER_PORT"] = meet[0], str(meet[1])
    return env


def script_environment(host: Host, threads: int) -> dict[str, str]:
    """What the script's process and its children see besides torchrun's variables: the error
    file torch.distributed.elastic's `@record` writes, the thread count the rank chose (torchrun
    passes OMP_NUM_THREADS on), NCCL's error handling as torchrun sets it; a value already set is
    kept."""
    env = torchrun_environment(
        host.rank,
        rendezvous(os.environ),
        job_id(os.environ) or host.run_dir.path.name,
        restart_count(os.environ) + int(os.environ.get(STEP_ATTEMPT_VARIABLE, "0") or 0),
    )
    env["TORCHELASTIC_ERROR_FILE"] = str(host.run_dir.path / "logs" / f"error-rank-{host.rank.rank:05d}.json")
    for name, value in (("OMP_NUM_THREADS", str(threads)), ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")):
        env[name] = os.environ.get(name, value)
    return env


def frozen_path(script: Path, code: Path) -> Path:
    """Where the job's frozen copy of a script file is (hpc.launching.snapshot), or the file itself
    when the ranks run unfrozen code (a hand-typed srun of an old run dir)."""
    frozen = code / SCRIPT_DIR / script.name
    return frozen if frozen.is_file() else script


@contextmanager
def raising_stops(signals: tuple[signal.Signals, ...]) -> Iterator[list[str]]:
    """While inside, each of `signals` raises ScriptStopped in the main thread (once: a second
    signal during the script's own clean-up is noted, not raised again). Yields the names of the
    signals received."""
    received: list[str] = []

    def stop(signum: int, frame: object) -> None:
        received.append(signal.Signals(signum).name)
        if len(received) == 1:
            raise (ScriptInterrupted if signum == signal.SIGINT else ScriptStopped)(received[0])

    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def starting_dir(workdir: str | None, script: Script, code: Path) -> Path:
    """Where the ranks start: `workdir` (launch.py's dir, or workdir= as given); None (a script
    file of the launch dir): its frozen copy, where its code files are copies and the rest links
    to the live files (hpc.config.freezing), so a file it reads by relative path (a config, a
    configurator.py) is the one frozen with it; a folder it makes is the run's own."""
    if workdir is not None:
        return Path(workdir)
    frozen = code / SCRIPT_DIR
    if frozen.is_dir():
        return frozen
    return script.path.parent if script.path is not None else Path.cwd()  # unfrozen: a hand-typed srun of an old run dir


def run_script(spec: str, args: list[str], workdir: str | None, host: Host, code: Path) -> ScriptResult:
    """Run the script to its end. Returns how it ended (completed, or stopped by a signal or by
    its own exit code 75); raises ScriptFailed for a non-zero exit and what the script raised."""
    import torch

    script = parse_script(spec, Path(workdir or "."))  # a script file's path is absolute (pinned at launch)
    os.environ.update(script_environment(host, torch.get_num_threads()))
    os.environ[RUN_DIR_VARIABLE] = str(host.run_dir.path)
    # The rank's interpreter started with PYTHONSAFEPATH (its code is the frozen copy, never the
    # working directory's); a `python helper.py` the script starts imports its siblings as usual.
    os.environ.pop("PYTHONSAFEPATH", None)
    as_launched(os.environ.get(TTY_VARIABLE))
    os.chdir(starting_dir(workdir, script, code))
    result = ScriptResult(spec)
    with raising_stops(host.signals) as received, hosted(host):
        try:
            call(script, args, code)
        except ScriptStopped as stopped:
            result.stopped_by = str(stopped)
        except Exception:
            if not received and not host.stop.raised:  # the stop flag is the run handle's while it runs
                raise
            result.stopped_by = received[0] if received else host.stop.signal_name  # torn down by the stop (a peer gone): a stop all the same
        except SystemExit as done:
            code_or_text = done.code
            if code_or_text == EXIT_RESUMABLE:
                result.stopped_by = f"the script's exit code {EXIT_RESUMABLE} (resumable)"
            elif code_or_text not in (None, 0):
                raise ScriptFailed(f"the script exited with {code_or_text!r}") from None
        result = with_handle_figures(result, host.handle)
    if not received:  # after a raw signal a collective may be left waiting on a peer: the exit ends it
        release_process_group()
    if received and result.stopped_by is None:  # a signal during the script's last instructions
        result.stopped_by = received[0]
    return result


class NotATerminal(io.FileIO):
    """A file descriptor that says it is no terminal, whatever it is."""

    def isatty(self) -> bool:
        return False


def as_launched(terminal_columns: str | None) -> None:
    """The script's stdout and stderr as the launching command's were, not as mpirun's: Open MPI
    gives every local rank a pseudo-terminal, so a script's `sys.stdout.isatty()` said yes with
    launch.py's output going to a file (tqdm's and rich's bars and colours in the log), and
    `shutil.get_terminal_size()` said 0 columns in a terminal (Open MPI issues 7868, 7900).
    `terminal_columns`: launch.py's terminal width, "0" for none, None: not launched locally."""
    if terminal_columns is None or not terminal_columns.isdigit():
        return
    if int(terminal_columns) > 0:
        os.environ.setdefault("COLUMNS", terminal_columns)  # shutil.get_terminal_size reads it first
        return
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper) and stream.isatty():
            raw = NotATerminal(stream.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, line_buffering=True))


def release_process_group() -> None:
    """Destroy the process group a script left started (torchrun's scripts should, many public
    ones don't), while the interpreter is whole: Gloo's worker threads let go of the script's
    last collective tensors just after they complete, and one that does so during the
    interpreter's exit aborts the process (`terminate called without an active exception`), a
    completed run ending with SIGABRT. Destroying waits for those threads; nothing is sent."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        log.info("destroyed the process group the script left started (end a script with dist.destroy_process_group())")


def call(script: Script, args: list[str], code: Path) -> None:
    """`python FILE args`, `python -m MODULE args`, or `MODULE.FUNCTION()` with argv set."""
    if script.path is not None:
        path = frozen_path(script.path, code)
        sys.argv = [str(path), *args]
        sys.path.insert(0, str(path.parent))  # as `python FILE` does: its sibling modules import
        runpy.run_path(str(path), run_name="__main__")
        return
    assert script.module is not None
    if script.function is None:
        sys.argv = [script.module, *args]  # runpy puts the module's file there, as `python -m` does
        runpy.run_module(script.module, run_name="__main__", alter_sys=True)
        return
    import importlib

    sys.argv = [f"{script.module}:{script.function}", *args]
    function = getattr(importlib.import_module(script.module), script.function)
    function()
