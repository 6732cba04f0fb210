"""build_loop: a run's loop made from its configs (engine, data plan, step policies), resumed
from the newest checkpoint, and the one log line that says what it trains."""

from __future__ import annotations

import logging
import time

from collectives.base import Collectives
from trainers import rngstreams
from trainers.boundary import StepBoundary
from trainers.checkpoint.recovery import resume_or_start
from trainers.checkpoint.registry import Registry
from trainers.checkpoint.state import LossScale, Progress
from trainers.config import accumulation_steps
from trainers.context import FitConfig, RunContext
from trainers.guard import BadStepGuard
from trainers.loop.dataplan import DataPlan, build_data_plan
from trainers.loop.engine import Engine, build_engine, placed_model
from trainers.loop.passes import Loop
from trainers.loop.policies import StepPolicies
from trainers.stragglers import StragglerWatch
from trainers.task import Task

log = logging.getLogger("trainers")

UNBOUNDED = 1 << 62  # max_steps unset


def build_loop(cfg: FitConfig, comm: Collectives, task: Task, run: RunContext) -> Loop:
    """Model, data, optimizer, schedule and gradient sync, resumed from the newest checkpoint."""
    model = placed_model(cfg, comm, task)
    accumulation = accumulation_steps(cfg.trainer, cfg.data.batch_size, comm.world_size)
    data = build_data_plan(task, comm, cfg.data.batch_size, cfg.trainer.seed, accumulation)
    total_steps = min(cfg.trainer.max_steps or UNBOUNDED, cfg.trainer.epochs * data.steps_per_epoch)
    engine = build_engine(cfg, comm, task, model, accumulation, total_steps)
    task_target = str(task.describe().get("task") or f"{type(task).__module__}.{type(task).__qualname__}")
    run.stop.phase = "resume"
    load_began = time.time()
    rngstreams.seed_rank(cfg.trainer.seed, comm.rank)  # its own stream from here on (a checkpoint's, if resumed)
    progress = Progress()
    registry = loop_registry(engine, progress)
    coordinator, resumed_from = resume_or_start(cfg.checkpoint, run.checkpoint_dir, comm, registry, progress, task_target)
    run.milestones.loaded(load_began, time.time())
    log_training_plan(cfg, task, data, engine, comm.world_size)
    run.steps.total_steps = total_steps if total_steps < UNBOUNDED else None
    policies = StepPolicies(
        StepBoundary(comm, run.stop, coordinator, run.watchdog, run.milestones),
        BadStepGuard(cfg.trainer.max_bad_steps),
        StragglerWatch(comm, run.host, cfg.trainer.straggler_every, cfg.trainer.straggler_ratio),
        cfg.trainer.max_steps,
        cfg.trainer.eval_every,
    )
    described = {**task.describe(), "task": task_target}
    return Loop(cfg, comm, run, task, engine, data, policies, progress, registry, resumed_from, described)


def loop_registry(engine: Engine, progress: Progress) -> Registry:
    """The built-in loop's state, kept as a script's run handle keeps its own (one layout, one
    restore path): the model with its buffers, optimizer, schedule, loss scale and data position."""
    return Registry(
        {"model": engine.model, "optimizer": engine.optimizer, "schedule": engine.schedule, "scaler": LossScale(engine.scaler), "progress": progress}
    )


def log_training_plan(cfg: FitConfig, task: Task, data: DataPlan, engine: Engine, world_size: int) -> None:
    """The one line that says what this run trains, on what, and how its gradients travel."""
    comm = cfg.comm
    plan = f"{world_size} ranks x batch {cfg.data.batch_size} x {engine.accumulation} micro-batches, {data.steps_per_epoch} steps per epoch"
    log.info(
        "training %s: %d train / %d validation%s samples, %s, comm %s (allreduce %s, buckets %.1f MiB, overlap %s, compression %s%s), "
        "global batch %d, lr %g, precision %s%s",
        task_name(task),
        len(data.train),
        len(data.val),
        f" / {len(data.held_out)} test" if data.held_out is not None else "",
        plan,
        comm.backend,
        comm.algorithm,
        comm.bucket_mb,
        comm.overlap,
        comm.compression,
        f", sharding {comm.sharding}" if comm.sharding != "none" else "",
        data.step_samples,
        engine.optimizer.param_groups[0]["initial_lr"],
        cfg.trainer.precision,
        ", compiled" if engine.train_module is not None else "",
    )


def task_name(task: Task) -> str:
    """`mlp (classify), 10 classes`: the model, the task, and a classifier's class count (labels
    0..10 make 11 classes, said where a user looks, not left to be found in the model's shape)."""
    described = task.describe()
    classes = f", {described['num_classes']} classes" if isinstance(described.get("num_classes"), int) else ""
    return f"{described.get('name', '?')} ({described.get('task', type(task).__name__)}){classes}"
