"""A rank's services for a job launch.py prepared, built one way for the built-in loop
(hpc.rank.main) and for a script's run handle (hpc.run): the step reporter, the stall watchdog
and the run's timeline milestones. The entry point and the handle both import this; the handle
never imports the entry point."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from hpc.env import STEP_ATTEMPT_VARIABLE, TTY_VARIABLE, RankInfo
from hpc.rank.lifecycle import EXIT_STALLED
from hpc.rank.scheduler import scheduler_of
from hpc.rank.signals import process_started
from hpc.rank.timeline import Timeline
from hpc.rundir import RunDir

if TYPE_CHECKING:
    from trainers.config import TrainerConfig
    from trainers.context import Milestones
    from trainers.reporting.reporter import StepReporter
    from trainers.watchdog import Watchdog

log = logging.getLogger("hpc.rank")


def terminal_columns() -> int:
    """How wide launch.py's terminal is; 0: it runs in none (hpc.launching.local says so in HPCTK_TTY).
    mpirun hands the ranks a pseudo-terminal of its own either way (0 columns wide), so their own
    isatty() and size cannot tell."""
    value = os.environ.get(TTY_VARIABLE, "0")
    return int(value) if value.isdigit() else 0


def attached_to_terminal() -> bool:
    return terminal_columns() > 0


def step_reporter(trainer: TrainerConfig, trackers: list[str], run_dir: RunDir, is_main: bool) -> StepReporter:
    """Where a job's steps and moments are reported: the run dir's files, the progress line and
    the sinks chosen (`trackers`, and the trainer's older flags: Prometheus, TensorBoard, MLflow,
    W&B), on rank 0; the other ranks' reporter only closes. The trackers are given the composed
    job once per start."""
    from trainers.reporting.reporter import StepReporter
    from trainers.reporting.trackers import SHORT_RETRIES, SinkSettings, chosen, opened_sinks

    if not is_main:
        return StepReporter(None)
    for name, value in SHORT_RETRIES.items():  # this rank's process only
        os.environ.setdefault(name, value)
    names = chosen(trackers, trainer.tensorboard, trainer.prometheus_file)
    sinks = opened_sinks(names, SinkSettings(run_dir.path, run_dir.steps, trainer.prometheus_file, trainer.log_every))
    reporter = StepReporter(
        run_dir.steps,
        log_every=trainer.log_every,
        terminal=sys.stdout if attached_to_terminal() else None,
        columns=terminal_columns(),
        sinks=sinks,
    )
    if sinks:  # the composed job, for the trackers (the other sinks take none)
        from omegaconf import OmegaConf

        composed = OmegaConf.to_container(OmegaConf.load(run_dir.config), resolve=False)
        reporter.config({str(key): value for key, value in composed.items()} if isinstance(composed, dict) else {})
    return reporter


def run_milestones(run_dir: RunDir, is_main: bool) -> Milestones:
    """The run's timeline (rank 0 records it: hpc.rank.timeline); the other ranks' only counts."""
    from trainers.context import Milestones

    return Milestones(Timeline(run_dir, os.environ, process_started()).record_start if is_main else None)


def start_watchdog(trainer: TrainerConfig, requeue: bool, run_dir: RunDir, rank: RankInfo) -> Watchdog | None:
    """trainers.watchdog (trainer.watchdog_s), ending the job on a stall: requeue it (where the
    scheduler can and cluster.requeue lets it) so it resumes from the last committed checkpoint,
    then exit; the launcher (srun --kill-on-bad-exit, mpirun) ends the other ranks, including a
    stopped one."""
    if trainer.watchdog_s is None:
        return None
    from trainers.watchdog import Watchdog

    def on_stall(message: str) -> None:
        log.error("%s; ending all %d ranks", message, rank.world_size)
        scheduler = scheduler_of(os.environ)
        job_id = scheduler.job_id()
        supervised = STEP_ATTEMPT_VARIABLE in os.environ  # the batch script starts the ranks again in the allocation
        if job_id is not None and not supervised and requeue and scheduler.can_requeue():
            error = scheduler.requeue(job_id)
            # Several ranks notice the stall; the first requeue wins, later ones find it pending.
            log.error(
                "requeued job %s: it resumes from the last committed checkpoint"
                if error is None
                else f"requeueing job %s: {error} (another rank may have requeued it first)",
                job_id,
            )
        logging.shutdown()
        os._exit(EXIT_STALLED)

    return Watchdog(trainer.watchdog_s, run_dir.heartbeats, rank.rank, rank.world_size, rank.host, on_stall, startup_s=trainer.watchdog_startup_s).start()
