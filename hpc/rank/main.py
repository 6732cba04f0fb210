"""What every rank runs: read the run dir's config, find its place, train, report.

    python -m hpc.rank.main RUN_DIR     (under mpirun, srun, or sbatch/train.sbatch)

Its first statement catches the stop signals, before any other import (hpc.rank.signals).

A stop (a signal, preemption, the time limit) ends in one line on rank 0 saying what happened
and what follows: `stopped by SIGUSR1 at step 40, checkpoint committed; preemption: requeueing
job 12 once every rank has exited ...`, or `...; not a Slurm job: ... (exit code 75)`.
"""

from __future__ import annotations

if __name__ == "__main__":  # srun, mpirun, a hand-typed sbatch script: no stop signal lost during the imports below
    from hpc.rank.signals import catch_stop_signals, report_fatal_signals

    catch_stop_signals()
    import os as _os

    from hpc.rank.warm import hand_over

    hand_over(_os.environ, "hpc.rank.main")  # a fork of the node's warm process is the rank; returns where none took it
    report_fatal_signals()
    from hpc.liveness import hold_from_env

    hold_from_env()  # the step supervisor sees this rank's death by its closed connection

import contextlib
import dataclasses
import gc
import importlib
import io
import logging
import os
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.env import RESULT_EXIT_VARIABLE, STEP_ATTEMPT_VARIABLE, RankInfo, cpus_per_task, job_id, rendezvous, restart_count
from hpc.interruptions import TIMELINE, restarts_in
from hpc.rank import dynamo, parking
from hpc.rank.binding import apply_binding, binding_for, rank_threads
from hpc.rank.diskfaults import end_on_storage_failure, storage_line
from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.rank.outcomes import failed_peer, forget_end, record_end, record_failure, wait_for_peers
from hpc.rank.scheduler import scheduler_of
from hpc.rank.services import attached_to_terminal, run_milestones, start_watchdog, step_reporter
from hpc.rank.signals import STOP_SIGNALS, caught_early, process_started
from hpc.rank.task import job_task
from hpc.rank.timeline import Timeline
from hpc.rank.warm import forked_line
from hpc.rundir import RunDir, read_jsonl
from hpc.runlock import hold_rank, release_all
from trainers.faults import FAULTS, FaultLatch, StorageFailure, storage_error

if TYPE_CHECKING:  # the module level stays light: srun starts it after catching the stop signals
    from collectives.base import Collectives
    from hpc.config.schema import JobConfig
    from hpc.rank.script import ScriptResult
    from trainers.context import FitResult
    from trainers.preemption import StopFlag
    from trainers.watchdog import Watchdog

# STOP_SIGNALS (hpc.rank.signals): each one stops at a step boundary with a checkpoint, never as a
# KeyboardInterrupt in the middle of a step.
log = logging.getLogger("hpc.rank")
CODE_ROOT = Path(__file__).resolve().parents[2]  # the toolkit's code: the frozen copy on Slurm (hpc.launching.snapshot)


class AboveTheBar(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]  # of a text stream
    """Log lines on a terminal that shows tqdm's progress bar: written through tqdm.write, which
    lifts the bar, prints the line, and draws the bar again below it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own rule: a handler never raises
            self.handleError(record)


def init_rank_logging(run_dir: RunDir, rank: RankInfo) -> None:
    """One log file per rank; rank 0 also prints to stdout. Every line names the rank."""
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    prefix = f"[rank {rank.rank}/{rank.world_size} {rank.host}]"
    file_handler = logging.FileHandler(run_dir.rank_log(rank.rank))
    file_handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(name)s: %(message)s"))
    handlers: list[logging.Handler] = [file_handler]
    if rank.is_main:
        console: logging.Handler
        if attached_to_terminal():  # a person watching: short lines, and the progress bar shows steps
            console = AboveTheBar(sys.stdout)  # no line glued to the bar's end, the bar kept below
            console.setFormatter(logging.Formatter("%(message)s"))
            console.addFilter(lambda record: record.name != "trainers.progress")
        else:  # a Slurm or mpirun log file: plain timestamped lines
            console = logging.StreamHandler(sys.stdout)
            console.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        handlers.append(console)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)
    logging.raiseExceptions = False  # a log file on a full disk: no traceback per line (trainers.faults tells it once)


def train_rank(run_dir_path: str) -> dict[str, Any]:
    """Train this rank of the run dir's job; the summary says how it ended and the exit code. A
    failure anywhere ends the rank with exit code 1 after result.json says why (report_failure)."""
    from omegaconf import OmegaConf

    from hpc.config.schema import apply_run_access, to_job_config

    run_dir = RunDir(Path(run_dir_path))
    rank = RankInfo.from_env(os.environ)
    if job_id(os.environ) is None:  # Slurm runs one instance of a job; a local run's ranks say they run
        hold_rank(run_dir.path)
    try:
        job = to_job_config(OmegaConf.load(run_dir.config))
        apply_run_access(job.run_access)  # logs, heartbeats, checkpoints: as private as the run dir
        init_rank_logging(run_dir, rank)
        if rank.is_main:
            run_dir.reserve_end_record()  # where the end goes if result.json finds the disk full
        return train_as_configured(job, run_dir, rank)
    except Exception as err:  # in start-up: the loop's and the script's own failures end the rank where they are caught
        report_failure(err, rank, run_dir, "ending")
        logging.shutdown()
        raise SystemExit(1) from None  # told above, in one line or from the user's frame down: not again on stderr
    finally:
        release_all()  # this rank's part is over, however: it no longer counts as running (hpc.runlock)


def train_as_configured(job: JobConfig, run_dir: RunDir, rank: RankInfo) -> dict[str, Any]:
    """train_rank's work, once the job is read and the rank logs: the built-in loop or the
    user's script, from start-up (signals, binding, collectives) to the summary. Everything
    started here ends in one place, in reverse order: the `with` block below."""
    import torch

    from collectives import describe, init_collectives
    from collectives.backends import entry
    from trainers.preemption import StopFlag

    if rank.is_main:
        scheduler_of(os.environ).note_run_dir(run_dir.path)  # where the batch script's step supervisor sees progress
    with contextlib.ExitStack() as started:
        stop = StopFlag().install(STOP_SIGNALS)  # before anything slow: a signal during start-up is not lost
        started.callback(stop.uninstall)
        early = caught_early()  # hpc.rank.signals caught it while Python and torch were still importing
        if early is not None:
            stop.note(*early, phase="start-up (imports)")
        binding = binding_for(job.topology, rank)
        binding_line = apply_binding(binding, job.topology)  # before MPI/NCCL start
        threads = rank_threads(job.trainer.threads_per_rank, cpus_per_task(os.environ), binding, rank.local_world_size)
        torch.set_num_threads(threads)
        log_start(rank, binding_line, threads)
        if job.script is not None:  # the user's own script instead of the built-in loop
            return script_to_end(job, run_dir, rank, stop)
        node_position = ring_position(job, rank)
        watchdog = start_watchdog(job.trainer, job.cluster.requeue, run_dir, rank)  # before init: a rank may never join either
        if watchdog is not None:
            started.callback(watchdog.close)
        meet = rendezvous(os.environ) if entry(job.comm.backend).rendezvous else None
        comm = init_collectives(job.comm, rank, node_position, meet, pinned_table=run_dir.allreduce_table)
        started.callback(comm.close)
        arm_parking(job, comm, meet is not None)
        stop.reclaim()  # the stop signals stay ours even if the communication library took one
        if watchdog is not None:  # stopped before the collectives close (closing twice is harmless)
            started.callback(watchdog.close)
        log.info("collectives: %s", describe(comm))
        try:
            result = run_fit(job, run_dir, rank, comm, stop, watchdog)
        except StorageFailure as err:  # raised alike on every rank at one step: each ends, none aborts the others
            return end_on_storage_failure(err, run_dir, rank)
        except BaseException as err:
            end_in_training(err, comm, rank, run_dir)  # parks, or ends the process (MPI_Abort on the engine)
            raise SystemExit(1) from None
        comm.barrier()  # outside abort_job: a peer lost here must not veto the requeue of a committed stop
    parking.disarm()  # trained: from here a client's end ends the rank again
    return after_fit(result, job, run_dir, rank, stop)


def log_start(rank: RankInfo, binding_line: str, threads: int) -> None:
    """The rank's first lines: its place, which start, its binding, its code, how it started."""
    attempt = os.environ.get(STEP_ATTEMPT_VARIABLE, "0")
    log.info(
        "rank %d local_rank %d node %d/%d on %s (launcher %s, restart %d%s)",
        rank.rank,
        rank.local_rank,
        rank.node_rank,
        rank.num_nodes,
        rank.host,
        rank.launcher,
        restart_count(os.environ),
        f", restart {attempt} in this allocation" if attempt != "0" else "",
    )
    log.info("%s, %d torch thread%s", binding_line, threads, "" if threads == 1 else "s")
    log.info("code: %s", CODE_ROOT)  # the frozen copy on Slurm (hpc.launching.snapshot)
    if (forked := forked_line()) is not None:
        log.info("%s", forked)


def script_to_end(job: JobConfig, run_dir: RunDir, rank: RankInfo, stop: StopFlag) -> dict[str, Any]:
    """The user's script on this rank, then its summary (after_script)."""
    try:
        ran = script_rank(job, run_dir, rank, stop)
    except StorageFailure as err:  # raised alike on every rank: each ends, none aborts the others
        return end_on_storage_failure(err, run_dir, rank)
    return after_script(ran, job, run_dir, rank, stop)


def script_rank(job: JobConfig, run_dir: RunDir, rank: RankInfo, stop: StopFlag) -> ScriptResult:
    """hpc.rank.script on this rank: a stop before the script starts ends the rank at once; an
    error the script raises (or its own non-zero exit) ends the job as a task's would."""
    from hpc.rank.hosting import Host
    from hpc.rank.script import ScriptFailed, ScriptResult, run_script

    if stop.raised:  # caught while Python and torch were importing
        return ScriptResult(str(job.script), stopped_by=stop.signal_name)
    log.info("script %s", shlex.join([str(job.script), *job.script_args]))
    forget_end(run_dir, rank.rank)  # before any collective of the script: rank 0 never reads an earlier start's word
    stop.phase = "training"
    try:
        host = Host.of(job, run_dir, rank, stop, STOP_SIGNALS)
        return run_script(str(job.script), job.script_args, job.workdir, host, CODE_ROOT)
    except StorageFailure:
        raise  # every rank's, at the same step: train_as_configured ends them alike
    except ScriptFailed as err:  # its own decision (argparse's exit 2, sys.exit("bad input")): it would repeat
        log.error("error: %s; ending all %d ranks", err, rank.world_size)
        record_failure(run_dir, rank.rank, rank.world_size, process_started(), err)
        end_for_good(rank, str(err))
        logging.shutdown()
        raise SystemExit(1) from None
    except Exception as err:
        report_failure(err, rank, run_dir, "ending")
        logging.shutdown()
        raise SystemExit(1) from None  # told above, from the user's frame down: not again on stderr


def end_for_good(rank: RankInfo, why: str) -> None:
    """No restart in the allocation and no requeue: the error would repeat."""
    scheduler = scheduler_of(os.environ)
    scheduler.mark_error(f"rank {rank.rank}: {why}")  # the step supervisor starts no restart
    forbidden = scheduler.forbid_requeue()
    if forbidden is not None:
        log.error("job %s will not be requeued: an error in the code or data would repeat", forbidden)


def ring_position(job: JobConfig, rank: RankInfo) -> int | None:
    """This node's place in a ring ordered by the switch tree; None: the allocation's order."""
    if not job.cluster.topology_conf or rank.num_nodes < 2:
        return None
    from hpc.errors import UserError
    from hpc.fabric.topology import ring_positions

    try:
        positions, ring_line = ring_positions(Path(job.cluster.topology_conf).read_text(), rank.hosts)
        log.info("%s; this node is number %d", ring_line, positions[rank.host])
        return positions[rank.host]
    except (OSError, UserError, KeyError) as err:  # a slower ring, not a reason to fail the job
        log.warning("rings keep the allocation's node order: cluster.topology_conf=%s unusable (%s)", job.cluster.topology_conf, err)
        return None


def run_fit(job: JobConfig, run_dir: RunDir, rank: RankInfo, comm: Collectives, stop: StopFlag, watchdog: Watchdog | None) -> FitResult:
    from trainers.context import FitConfig, RunContext
    from trainers.loop.fit import fit

    fit_cfg = FitConfig(model=job.model, data=job.data, optim=job.optim, trainer=job.trainer, comm=job.comm, checkpoint=job.checkpoint)
    context = RunContext(
        checkpoint_dir=run_dir.checkpoints,
        config_text=run_dir.config.read_text(),
        stop=stop,
        steps=step_reporter(job.trainer, job.trackers, run_dir, rank.is_main),
        host=rank.host,
        watchdog=watchdog,
        milestones=run_milestones(run_dir, rank.is_main),
    )
    return fit(fit_cfg, comm, job_task(job), context)


def import_without_collection(*modules: str) -> None:
    """Import `modules` with Python's cyclic collector off, then freeze what they allocated out
    of every later collection and turn collection back on, before any of the user's code runs.
    torch allocates hundreds of thousands of long-lived objects, and the collections that
    allocation triggers traverse them all, again and again; frozen, they are not traversed
    either by the collections during torch._dynamo's import (the constructor of every
    torch.optim optimizer imports it, after the collectives start, as before). 5.8 -> 4.3 s of
    CPU per rank start on a 2-core machine (docs/benchmarks.md). Only the imports: one that
    fails here fails again, and is reported, where the rank needs the module."""
    gc.disable()
    try:
        for module in modules:
            with contextlib.suppress(Exception):  # reported where it is needed (above)
                importlib.import_module(module)
    finally:
        gc.freeze()
        gc.enable()


def arm_parking(job: JobConfig, comm: Collectives, formed_again: bool) -> None:
    """A rank on a group that can be formed again (torch.distributed's rendezvous, not an MPI
    world) of a Slurm job may keep its process across a restart in the allocation (hpc.rank.parking)."""
    if job.cluster.in_process_restart and formed_again and job_id(os.environ) is not None:
        parking.arm(os.environ.get(parking.SLOT_VARIABLE), getattr(comm, "abandon", None))


def end_in_training(err: BaseException, comm: Collectives, rank: RankInfo, run_dir: RunDir) -> None:
    """A survivor of a peer's end (its heartbeats go on) waits for its step's end and parks where
    it may (Parked); any other failure ends the job (abort_job)."""
    if parking.peer_gone(err):
        parking.wait_for_end(err, log.warning)
    abort_job(err, comm, rank, run_dir)


def abort_job(err: BaseException, comm: Collectives, rank: RankInfo, run_dir: RunDir) -> None:
    """The other ranks would wait in their next collective forever: end the whole job."""
    parking.raise_if_parking()  # the step ended under this rank, which parks (hpc.rank.parking)
    report_failure(err, rank, run_dir, "aborting")
    logging.shutdown()
    comm.abort(1)


def report_failure(err: BaseException, rank: RankInfo, run_dir: RunDir, ending: str) -> None:
    """This rank failed (the job ends next, `ending` all ranks): result.json and its marker say
    so (hpc.rank.outcomes), the log tells why: a toolkit refusal in one line, anything else with
    its traceback from the user's own frame down. An error that would repeat (hpc.rank.failures:
    by its kind, or the same at the same step after a restart) also keeps Slurm from starting
    the job again; any other is a failure like a lost rank, which the step supervisor and the
    requeue count against the budget."""
    from hpc.rank.failures import from_users_frame, newest_step, one_line, repeats_here

    parking.raise_if_parking()  # not this rank's failure: its step ended under it (hpc.rank.parking)
    lasting, why = repeats_here(run_dir.path, err, rank.rank, process_started())
    record_failure(run_dir, rank.rank, rank.world_size, process_started(), err)
    refused, found = FaultLatch(), storage_error(err)
    if found is not None and found.filename is not None and refused.note(found) and refused.first is not None:  # a write refused outside the vote's reach
        line = storage_line(refused.first.line(), newest_step(run_dir.path) or 0, refused.first.remedy, run_dir)
        log.error("error: %s; %s all %d ranks", line, ending, rank.world_size)
    elif one_line(err):  # a user-fixable cause: one line, no traceback
        log.error("error: %s; %s all %d ranks", err, ending, rank.world_size)
    else:
        log.error("rank %d failed; %s all %d ranks", rank.rank, ending, rank.world_size, exc_info=(type(err), err, from_users_frame(err, CODE_ROOT)))
    if why:
        log.error("%s", why)
    if lasting:
        end_for_good(rank, f"{type(err).__name__}: {err}")
    else:
        log.error(
            "%s need not repeat: counted as a failure, like a lost rank (restart or requeue from the newest checkpoint, within the failure budget)",
            type(err).__name__,
        )


def after_script(result: ScriptResult, job: JobConfig, run_dir: RunDir, rank: RankInfo, stop: StopFlag) -> dict[str, Any]:
    """after_fit for a script: the same summary and requeue. What it saved is its own. A script
    that returned has completed only where every rank's did (hpc.rank.outcomes): rank 0 waits
    for the others' word before it says so."""
    if result.stopped_by and stop.signal_name is None:
        stop.note(result.stopped_by, time.time(), "training")
    if rank.world_size > 1:
        failed = failed_peer(run_dir, rank.world_size, process_started()) if rank.is_main and result.stopped_by else None
        if failed is not None:  # the launcher ended this rank after a peer's failure: result.json is that rank's
            log.error("rank %d failed (%s): the run did not complete", *failed)
            return {"status": "failed", "exit_code": 1, "failed_rank": failed[0], "error": failed[1]}
        record_end(run_dir, rank.rank, process_started(), "stopped" if result.stopped_by else "completed")
        other = wait_for_peers(run_dir, rank.world_size, process_started()) if rank.is_main and not result.stopped_by else None
        if other is not None and other[1] == "failed":  # result.json is the failed rank's
            log.error("rank %d failed (%s): the run did not complete", other[0], other[2])
            return {"status": "failed", "exit_code": 1, "failed_rank": other[0], "error": other[2]}
        if other is not None:  # a peer was stopped before its script ended: so is the run
            log.info("rank %d was stopped before its script ended: the run stops", other[0])
            result = dataclasses.replace(result, stopped_by=f"rank {other[0]} stopped")
    return after_fit(result, job, run_dir, rank, stop)


def after_fit(result: FitResult | ScriptResult, job: JobConfig, run_dir: RunDir, rank: RankInfo, stop: StopFlag) -> dict[str, Any]:
    """The summary (result.json on rank 0), and after a stop what follows: a requeue by the batch
    script, by rank 0 itself, or exit code 75 for whoever starts the run dir again."""
    status = "stopped" if result.stopped_by else "completed"
    scheduler = scheduler_of(os.environ)
    # Restarts as hpc.status counts them: Slurm's requeues, or the starts rank 0's timeline saw (a local relaunch too)
    restarts = max(restart_count(os.environ), restarts_in(read_jsonl(run_dir.path / TIMELINE)))
    summary = {**result.__dict__, "world_size": rank.world_size, "num_nodes": rank.num_nodes, "status": status, "restarts": restarts}
    summary["finished"] = status == "completed"  # what a script waits for: a stop writes result.json too
    if not result.stopped_by:
        summary["exit_code"] = 0
        if rank.is_main and FAULTS.first is not None:  # refused after the last step's vote: the final save's marker, the last records
            return end_on_storage_failure(StorageFailure(FAULTS.first.line(), result.steps, FAULTS.first, rank.rank), run_dir, rank, summary)
        if rank.is_main:
            run_dir.write_result(summary)
            scheduler.mark_finished()  # the batch script's trap never requeues a finished run
        return summary
    if not rank.is_main:  # rank 0 decides what follows; a requeue by the batch script wants exit 0
        summary["exit_code"] = 0 if scheduler.requeued_by_batch_script() else EXIT_RESUMABLE
        log.info("stopped with every rank at step %d; rank 0 says what follows", result.steps)
        return summary
    received = datetime.fromtimestamp(stop.received_at or time.time())
    plan = scheduler.plan_after_stop(received, job.cluster.signal_seconds)
    what, requeue_id = plan.what, plan.requeue_id
    summary["exit_code"] = plan.exit_code
    run_dir.write_result(summary)  # before requeueing: Slurm may end us next
    # Another rank's signal may have ended the step before rank 0's own came (during the save): name that one.
    stopped_by = stop.signal_name or str(result.stopped_by)
    Timeline(run_dir, os.environ, process_started()).record_stop(stopped_by, received.timestamp(), stop.received_in, what.split(":")[0], result.steps)
    hit = f" (received during {stop.received_in})" if stop.received_in not in (None, "training") else ""  # training: the usual case
    if job.script and not getattr(result, "handle", False):  # a script without the run handle: its steps are its own
        saved, at = "the script keeps what it saved", ""
    else:
        saved, at = "checkpoint committed" if result.steps else "nothing trained yet, nothing to save", f" at step {result.steps}"
    stopped = f"stopped by {stopped_by}{hit}{at}, {saved}"
    if requeue_id is None:
        log.info("%s; %s%s", stopped, what, f" (exit code {plan.exit_code})" if plan.exit_code else "")
    elif scheduler.request_requeue(requeue_id, stopped):
        log.info("%s; %s once every rank has exited (the batch script does it)", stopped, what)
    else:  # a hand-typed batch script without the trap: requeue from here
        log.info("%s; %s", stopped, what)
        error = scheduler.requeue(requeue_id)
        if error:
            log.error("requeueing job %s failed: %s; requeue it by hand to resume", requeue_id, error)
            summary["exit_code"] = EXIT_RESUMABLE
    return summary


def whole_lines() -> None:
    """One write per printed line on this rank's stdout and stderr. Under PYTHONUNBUFFERED
    (launch.py's: progress shows at once) print() writes its text, separators and newline
    apart, and mpirun forwards each write on its own, so two ranks' lines were spliced on the
    console (a user's script printing on every rank). A program's own flush() still writes at
    once (tqdm's bar)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def main(argv: list[str]) -> int:
    import argparse

    whole_lines()

    parser = argparse.ArgumentParser(prog="python -m hpc.rank.main", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory launch.py (or sbatch/train.sbatch) prepared: its config.yaml")
    run_dir = parser.parse_args(argv).run_dir
    if not RunDir(Path(run_dir)).config.is_file():
        print(f"error: {run_dir} is not a run directory (no config.yaml)", file=sys.stderr)
        return 2
    import_without_collection("torch")  # torch initialises no device: before the binding, as always
    dynamo.stand_in()  # torch._dynamo imported only if the job uses more of it than its optimizers do (a fork has the warm process's)
    try:
        summary = train_rank(run_dir)
        code = int(summary["exit_code"])
    finally:
        # Everything is written: the interpreter's last collection of torch's (and dynamo's)
        # objects took 1.2 of a rank's 1.5 s of exit on a 2-core machine, every job, every rank.
        # Not for a rank that parks: its training is still reachable from the unwinding, and
        # frozen it would never be freed in the process that trains again (hpc.rank.parking).
        if not parking.parking():
            gc.freeze()
    told = code == EXIT_RESUMABLE or (code == 1 and summary.get("recorded") is True)  # a failure all ranks agreed on, recorded
    if told and os.environ.get(RESULT_EXIT_VARIABLE) == "1":
        return 0  # hpc.launching.ranks returns result.json's code: a non-zero exit here can hang mpirun (and prints its banner)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
