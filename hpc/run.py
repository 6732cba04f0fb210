"""The run handle: the toolkit's guarantees for a training loop the user owns.

    from hpc.run import start_run

    run = start_run(model=model, optimizer=optimizer, scheduler=scheduler)  # resumes, or starts fresh
    while run.step < max_steps:
        ...                                   # the script's own step
        if run.end_step(loss=loss):           # every rank alike: saves when due; True: stop now
            break
    run.finish()                              # the final save; after a stop, ends the process to resume

`start_run` registers the state to keep (models, optimizers, schedulers, the grad scaler, any
object with state_dict/load_state_dict, `per_rank(obj)` for state that differs between ranks,
plain values read and set as `run["name"]`) and restores the newest committed checkpoint with
each rank's RNG streams. `end_step` is one small allreduce per step (the metrics, the stop vote
and the save handshake ride together), `log` writes metrics.jsonl, `save` checkpoints now.

Under launch.py (`script=`) the handle uses the job's run dir and settings (checkpoint.*,
trainer.log_every, trainer.watchdog_s, Prometheus, TensorBoard) and the rank's stop flag; started
by hand (torchrun, mpirun, srun) it needs a run dir: `start_run(run_dir=...)` or HPCTK_RUN_DIR.
It talks to the other ranks through torch.distributed when the script started a process group,
through Horovod when the script initialised it, else through MPI (mpi4py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc.env import RUN_DIR_VARIABLE, RankInfo
from hpc.rank import hosting
from hpc.rank.lifecycle import EXIT_RESUMABLE
from hpc.rank.scheduler import scheduler_of
from hpc.rundir import RunDir
from trainers.data.positions import RandomWindows, ShuffledBatches, StreamCursor  # data positions a run keeps

if TYPE_CHECKING:
    from collectives.base import Collectives
    from trainers.handle import Handle
    from trainers.preemption import StopFlag

log = logging.getLogger("hpc.run")

__all__ = ["RandomWindows", "Run", "ShuffledBatches", "StreamCursor", "per_rank", "start_run"]


def current() -> Run | None:
    """The handle this process started (None: the script started none)."""
    return _current


_current: Run | None = None


def per_rank(obj: Any) -> Any:
    """Mark state that differs between ranks (a data cursor): each rank keeps its own."""
    from trainers.checkpoint.registry import per_rank as mark

    return mark(obj)


def start_run(
    run_dir: str | os.PathLike[str] | None = None,
    *,
    save_every_steps: int | None = None,
    save_every_minutes: float | None = None,
    checkpoint_uri: str | None = None,
    **state: Any,
) -> Run:
    """Register `state`, restore the newest committed checkpoint into it (or start fresh), and
    return the handle. Every rank calls it, with the same names. A checkpoint is saved every
    `save_every_steps` steps and every `save_every_minutes` minutes (asynchronously), and when
    a stop is agreed; defaults: launch.py's checkpoint.every_steps and checkpoint.every_minutes
    (0 and 10), the same by hand. `checkpoint_uri` (s3://bucket/prefix): checkpoints there, in
    the run's own place, instead of the run dir (default: launch.py's checkpoint.uri)."""
    global _current
    if _current is not None and not _current.handle.finished:
        raise RuntimeError("start_run() was called twice; one run handle per process")
    host = hosting.host()
    handlers = {sig: signal.getsignal(sig) for sig in host.signals} if host is not None else {}  # the script's: a signal raises in it
    if host is None:  # under launch.py the rank says a refusal in one line
        _say_refusals_in_one_line()
    _current = Run(*_build(run_dir, state, save_every_steps, save_every_minutes, checkpoint_uri), handlers)
    hosting.started(_current.handle)
    return _current


def _mark_hand_started(where: RunDir, rank: RankInfo) -> None:
    """A run dir of ranks started by hand, as hpc.status knows launch.py's: marked as a run dir,
    its root remembered (rank 0), and held by each rank while it lives outside Slurm (RUNNING)."""
    from hpc.rundir import mark_run_dir
    from hpc.runlock import hold_rank
    from hpc.runroots import remember

    if rank.rank == 0:
        try:
            mark_run_dir(where.path)
        except OSError:
            pass  # a run dir that takes no write fails where the handle writes, in one line
        remember(where.path.parent)
    if scheduler_of(os.environ).job_id() is None:
        hold_rank(where.path)


def _say_refusals_in_one_line() -> None:
    """Ranks started by hand: a refusal of the handle's (a TaskError) that the script lets through
    ends the process with its one line on stderr, no traceback (under torchrun a traceback
    would bury it above the ChildFailedError summary). A script may still catch it. Every rank
    that met it says it; one all ranks meet alike before they communicate, rank 0 alone."""
    previous = sys.excepthook
    if getattr(previous, "says_refusals", False):
        return

    def hook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        from trainers.task import RefusedOnEveryRank, TaskError

        if not issubclass(kind, TaskError):
            previous(kind, error, trace)
        elif not isinstance(error, RefusedOnEveryRank) or RankInfo.from_env(os.environ).rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)

    hook.says_refusals = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class Run:
    """The handle a script holds (see the module's docstring)."""

    def __init__(self, handle: Handle, run_dir: RunDir, rank: RankInfo, handlers: dict[signal.Signals, Any]) -> None:
        self.handle = handle
        self._run_dir, self._rank = run_dir, rank
        self._handlers = handlers  # the stop signals' handlers before the handle took them

    def _record_end(self) -> None:
        """Started by hand, the end as launch.py's ranks record it (result.json, rank 0), for
        hpc.status; this process no longer counts as a running rank (its training is over)."""
        from hpc.runlock import release_all

        handle = self.handle
        if self.is_main:
            stopped = handle.stopped_by is not None
            validation = {**handle.validation, **{name: value for name, value in handle.logged.items() if name.startswith("val_")}}
            summary: dict[str, Any] = {"status": "stopped" if stopped else "completed", "finished": not stopped, "exit_code": EXIT_RESUMABLE if stopped else 0}
            summary.update(handle=True, steps=handle.step, resumed_from=handle.resumed_from, loss=handle.last.get("loss"), val_metrics=validation)
            self._run_dir.write_result({**summary, "stopped_by": handle.stopped_by, "world_size": self.world_size})
        release_all()

    @contextlib.contextmanager
    def _faults_end_in_one_line(self) -> Iterator[None]:
        """Started by hand, a write the file system refused (a StorageFailure, raised alike on
        every rank at one step) ends each rank with exit 1 and no traceback; rank 0 says it in
        one line and records it for hpc.status. Under launch.py the rank's main ends it."""
        from trainers.faults import StorageFailure

        try:
            yield
        except StorageFailure as err:
            if hosting.host() is not None:
                raise
            if self.is_main:
                from hpc.rank.diskfaults import end_on_storage_failure

                end_on_storage_failure(err, self._run_dir, self._rank)
            _settle_signals(self)
            raise SystemExit(1) from None

    @property
    def step(self) -> int:
        """Steps done: 0 on a fresh start, the checkpoint's step after a resume."""
        return self.handle.step

    @property
    def resumed_from(self) -> int | None:
        return self.handle.resumed_from

    @property
    def rank(self) -> int:
        return self.handle.comm.rank

    @property
    def world_size(self) -> int:
        return self.handle.comm.world_size

    @property
    def is_main(self) -> bool:
        return self.handle.comm.rank == 0

    @property
    def stopped_by(self) -> str | None:
        return self.handle.stopped_by

    def __getitem__(self, name: str) -> Any:
        return self.handle.registry.values[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in self.handle.registry.values:
            raise KeyError(f"{name!r} is not a registered plain value; register it in start_run({name}=...)")
        self.handle.registry.values[name] = value

    def end_step(self, **metrics: Any) -> bool:
        """After each optimizer step, on every rank: the step is counted, `metrics` (numbers or
        one-element tensors) averaged over ranks into steps.jsonl, a checkpoint saved when due;
        True when the ranks must stop now (preemption, time limit, Ctrl-C): the state is saved."""
        with self._faults_end_in_one_line():
            return self.handle.end_step(metrics)

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """A moment's record for every sink (metrics.jsonl keeps it; rank 0's values, no
        communication): `val_loss=...` there is what hpc.status, hpc.report and sweep.objective
        read, and what the trackers plot as val/loss."""
        self.handle.log(metrics, step)

    def sync_gradients(self, model: Any, optimizer: Any, sharding: str | None = None) -> None:
        """For a script without DistributedDataParallel or Horovod: `optimizer.step()` first
        averages the gradients over the ranks on the toolkit's engine (buckets, overlapped with
        backward); on a fresh start every rank takes rank 0's weights. `sharding`: "optimizer"
        (ZeRO-1: each rank keeps the optimizer state of its part of the parameters) or
        "gradients" (ZeRO-2: and receives only that part of the averaged gradients; clip with
        `optimizer.clip_grad_norm_(max_norm)`, which computes the norm over all ranks' parts);
        None: the job's comm.sharding under launch.py, else "none". The optimizer must be
        registered in start_run: its shards are saved by every rank and reshard on resume."""
        from collectives.backends import entry
        from collectives.config import CommConfig
        from trainers.task import TaskError

        host = hosting.host()
        chosen = sharding if sharding is not None else (host.sharding if host is not None else "none")
        engine = entry("mpi")  # the toolkit's engine syncs here, whatever started the ranks
        if chosen not in engine.shardings:
            raise TaskError(f"sync_gradients(sharding={chosen!r}): one of {', '.join(engine.shardings)}")
        if self.world_size == 1:
            return
        from collectives.base import broadcast_module
        from trainers.checkpoint.registry import unwrapped

        if self.resumed_from is None:
            broadcast_module(self.handle.comm, unwrapped(model))  # a resume loaded rank 0's weights everywhere already
        cfg = CommConfig(sharding=chosen)
        if chosen == "none":
            from collectives.optimizer import apply_distributed_optimizer

            apply_distributed_optimizer(optimizer, model, self.handle.comm, cfg)
            return
        from collectives.zero import STAGES, shard_optimizer

        shard_optimizer(optimizer, unwrapped(model), self.handle.comm, cfg, STAGES[chosen])

    def save(self) -> None:
        """A checkpoint of the current step now (every rank calls it at the same point)."""
        with self._faults_end_in_one_line():
            self.handle.save(synchronous=True)

    def finish(self) -> None:
        """After the loop: the final checkpoint. After a stop, ends the process instead (exit
        code 75, or a Slurm requeue) so that the code after the loop runs only once training is
        complete."""
        with self._faults_end_in_one_line():
            self.handle.finish()
        if hosting.host() is None:
            self._record_end()
        stopped = self.handle.stopped_by is not None
        if stopped and hosting.host() is None:
            if self.is_main:
                _after_stop_unhosted(self.handle)
            self.handle.comm.barrier()  # no rank exits (75: srun or mpirun end the rest) before rank 0 asked for the requeue
        _settle_signals(self)
        if stopped:
            raise SystemExit(EXIT_RESUMABLE)


def _build(
    run_dir: str | os.PathLike[str] | None, state: dict[str, Any], every_steps: int | None, every_minutes: float | None, uri: str | None
) -> tuple[Handle, RunDir, RankInfo]:
    import dataclasses

    from trainers.config import CheckpointConfig
    from trainers.preemption import StopFlag
    from trainers.task import RefusedOnEveryRank

    host = hosting.host()
    if host is not None:
        where, rank, cfg = host.run_dir, host.rank, host.checkpoint
        if run_dir is not None and Path(run_dir).resolve() != where.path.resolve():
            log.warning("start_run(run_dir=%s) ignored under launch.py: the job's run dir %s keeps the checkpoints", run_dir, where.path)
        host.stop.reclaim()  # the stop signals set a flag now, checked at step boundaries
        stop = host.stop
    else:
        chosen = run_dir if run_dir is not None else os.environ.get(RUN_DIR_VARIABLE)
        if not chosen:
            raise RefusedOnEveryRank(f"start_run() needs a run dir outside launch.py: set {RUN_DIR_VARIABLE}=DIR (or pass start_run(run_dir=...))")
        where, rank, cfg = RunDir(Path(chosen)), RankInfo.from_env(os.environ), CheckpointConfig()
        where.path.mkdir(parents=True, exist_ok=True)
        _mark_hand_started(where, rank)
        from hpc.rank.signals import STOP_SIGNALS

        stop = StopFlag().install(STOP_SIGNALS)
        if rank.is_main and not logging.getLogger().handlers:  # a script that set up no logging still hears the handle
            for name in ("hpc", "trainers"):
                said = logging.getLogger(name)
                if not said.handlers:
                    handler = logging.StreamHandler(sys.stderr)
                    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
                    said.addHandler(handler)
                    said.setLevel(logging.INFO)
    if every_steps is not None:
        cfg = dataclasses.replace(cfg, every_steps=every_steps)
    if every_minutes is not None:
        cfg = dataclasses.replace(cfg, every_minutes=every_minutes)
    if uri is not None:
        cfg = dataclasses.replace(cfg, uri=uri)
    try:
        return _start(where, rank, cfg, stop, host, state), where, rank
    except BaseException:
        if host is None:
            stop.uninstall()  # the signals are the process's again
        raise


def _start(where: RunDir, rank: RankInfo, cfg: Any, stop: StopFlag, host: hosting.Host | None, state: dict[str, Any]) -> Handle:
    from trainers.boundary import StepBoundary
    from trainers.checkpoint.registry import Registry
    from trainers.checkpoint.saving import SaveCoordinator
    from trainers.handle import Handle
    from trainers.reporting.reporter import StepReporter

    registry = Registry(state)
    comm, owned = _collectives(rank)
    coordinator = SaveCoordinator.in_dir(where.checkpoints, comm, cfg) if cfg.enabled else None
    handle = Handle(comm, registry, StepBoundary(comm, stop, coordinator), owned_comm=owned)
    try:
        if host is not None:
            _adopt_job_settings(handle, host)
        else:
            handle.reporter = StepReporter(where.steps if comm.rank == 0 else None)
        handle.agree_on_registry()
        stop.phase = "resume"
        began = time.time()
        handle.restore(where.checkpoints, cfg.resume)
        handle.boundary.milestones.loaded(began, time.time())
        stop.phase = "training"
        return handle
    except BaseException:
        handle.close()
        if owned:
            comm.close()
        raise


def _adopt_job_settings(handle: Handle, host: hosting.Host) -> None:
    """launch.py's job: its reporting, watchdog, run timeline and config."""
    from hpc.rank.services import run_milestones, start_watchdog, step_reporter

    run_dir, main = host.run_dir, host.rank.is_main
    handle.reporter = step_reporter(host.trainer, host.trackers, run_dir, main)
    handle.boundary.watchdog = start_watchdog(host.trainer, host.requeue, run_dir, host.rank)
    handle.boundary.milestones = run_milestones(run_dir, main)
    handle.config_text = run_dir.config.read_text()


def _collectives(rank: RankInfo) -> tuple[Collectives, bool]:
    """Whom the handle talks through, and whether it started that itself (and closes it)."""
    import torch.distributed as dist

    from collectives.base import SingleProcess
    from trainers.task import TaskError

    if dist.is_available() and dist.is_initialized():
        from collectives.torchdist import TorchDistCollectives

        return TorchDistCollectives.joined(), False
    horovod = sys.modules.get("horovod.torch")
    if horovod is not None and horovod.is_initialized():
        from collectives.horovod import HorovodCollectives

        return HorovodCollectives(horovod), False
    if rank.world_size == 1:
        return SingleProcess(), False
    if rank.launcher == "torchrun":
        raise TaskError("start_run() under torchrun needs the process group first: call torch.distributed.init_process_group() before start_run()")
    from collectives.mpi import MpiCollectives

    return MpiCollectives.from_world(), True


def _settle_signals(run: Run) -> None:
    """After the handle's last step, a stop signal interrupts the script again (hosted), or
    whatever the process had before (started by hand)."""
    handle = run.handle
    if handle.owned_comm:
        handle.comm.close()
        handle.owned_comm = False
    if run._handlers:
        for sig, handler in run._handlers.items():
            signal.signal(sig, handler)
    else:
        handle.stop.uninstall()


def _after_stop_unhosted(handle: Handle) -> None:
    """Rank 0 of ranks started by hand: requeue the Slurm job, or say how to resume."""
    stop, scheduler = handle.stop, scheduler_of(os.environ)
    plan = scheduler.plan_after_stop(datetime.fromtimestamp(stop.received_at or time.time()), 0)
    log.info("stopped by %s at step %d, checkpoint committed; %s", handle.stopped_by, handle.step, plan.what)
    if plan.requeue_id is not None:
        error = scheduler.requeue(plan.requeue_id)
        if error:
            log.error("requeueing job %s failed: %s; requeue it by hand to resume", plan.requeue_id, error)
