"""One run once built (`Loop`): passes over the data, the step and its bookkeeping, the votes the
ranks sum after every step (`StepSums`: the stop vote and the save handshake as named fields),
evaluation at the end of an epoch, rollback after non-finite steps, and saving.
trainers.fit drives it; build_loop makes it from the configs, resumed from the newest checkpoint.

A step reads one thing back from the device: its sums (loss, non-finite flag, metric sums, the
votes), and it reads them a step late, once the next step is queued, so a GPU always has the next
step's work while the host waits. A non-finite step is skipped on the device (trainers.optim.
step_unless) and counted when its sums are read; whatever the sums decide (stop, save, roll back)
every rank decides at the same step, because every rank reads the same sums at the same point."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from collectives.base import Collectives, broadcast_module
from collectives.fsdp import shard_model
from collectives.gradsync import GradientSync, build_gradient_sync
from trainers import metricnames, rngstreams
from trainers.boundary import PendingVote, StepBoundary, StepVote
from trainers.config import accumulation_steps, scaled_lr
from trainers.context import FitConfig, RunContext
from trainers.data import Prefetcher
from trainers.evaluation import average_buffers, evaluate
from trainers.guard import BadStepGuard, skip_past
from trainers.loader import Pass, WorkerLoader
from trainers.memory import peaks_over_ranks
from trainers.metrics import MetricsWriter
from trainers.optim import build_optimizer, build_schedule, step_unless
from trainers.recompute import recompute_in_backward
from trainers.recovery import agree_on_newest, resume_or_start, roll_back
from trainers.reporting import PHASES, four_places
from trainers.sampler import ShardSampler
from trainers.saving import SaveCoordinator
from trainers.shards import own_state
from trainers.state import Progress, restore, rng_state, shared_state
from trainers.stragglers import StragglerWatch
from trainers.task import MapDataset, Place, StepOutput, Task, TaskError, pin, read_items

log = logging.getLogger("trainers")


@dataclass(frozen=True)
class StepSums:
    """A step's figures summed over the ranks; they ride on the step boundary's vote, in the
    order of `LocalStep.values` (the numbers the host knows first: they travel in one copy)."""

    seen: float  # samples
    phases: tuple[float, ...]  # seconds per PHASES entry, as the host saw them
    loss: float  # sum of per-sample losses
    nonfinite: float  # ranks whose averaged gradients were not finite (all or none)
    grad_norm: float  # the averaged gradients' global 2-norm before clipping, summed over the ranks (0 without clipping)
    metrics: tuple[float, ...]  # the task's metric sums, in Loop.metric_names order
    vote: StepVote

    @classmethod
    def of(cls, vote: StepVote) -> StepSums:
        seen, *rest = vote.values
        phases, (loss, nonfinite, grad_norm, *metrics) = rest[: len(PHASES)], rest[len(PHASES) :]
        return cls(seen, tuple(phases), loss, nonfinite, grad_norm, tuple(metrics), vote)


@dataclass
class LocalStep:
    """This rank's figures of the step in progress; its micro-batches add up. The loss and the
    task's tensor sums stay on the device until the step's sums are read."""

    data_wait_before: float  # the prefetcher's wait counter when the step began
    started: float = field(default_factory=time.perf_counter)
    loss: torch.Tensor | float = 0.0  # the sum of per-sample losses (float64)
    seen: int = 0
    sums: dict[str, torch.Tensor | float] = field(default_factory=dict)  # the task's metric sums
    micro_batches: int = 0

    def add(self, out: StepOutput) -> None:
        weighted = out.loss.detach().to(torch.float64) * out.count
        first = self.micro_batches == 0
        self.micro_batches += 1
        self.loss = weighted if first else self.loss + weighted
        self.seen += out.count
        for name, value in out.sums.items():  # tensors as the task gave them (the vote stacks them to float64)
            if isinstance(value, torch.Tensor):
                value = value.detach() if value.requires_grad else value
            else:
                value = float(value)
            before = self.sums.get(name)
            self.sums[name] = value if before is None else before + (value.to(torch.float64) if isinstance(value, torch.Tensor) else value)

    def values(self, phases: tuple[float, ...], update: Update, names: tuple[str, ...]) -> list[torch.Tensor | float]:
        """What the ranks sum, as StepSums reads it back."""
        return [self.seen, *phases, self.loss, update.nonfinite, update.grad_norm, *(self.sums.get(name, 0.0) for name in names)]


def host_number(value: Any) -> float:
    """A learning rate as a Python number, without waiting for a device (a tensor lr on a GPU, as
    capturable optimizers keep it, is not read: NaN)."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" else math.nan
    return float(value)


@dataclass(frozen=True)
class Update:
    """What the optimizer step leaves for the step's record: device values, read with its sums."""

    nonfinite: torch.Tensor | float  # 1 where the averaged gradients were not finite (the update skipped)
    grad_norm: torch.Tensor | float  # their global 2-norm before clipping (0.0 where nothing clips)
    lr: float  # the first parameter group's learning rate for this step


@dataclass(frozen=True)
class InFlight:
    """A finished step whose sums are on their way (its vote launched, not yet read)."""

    step: int
    position_before: int  # the data position where the step's samples began
    position_after: int
    host_s: float  # the step's time on the host, until its vote was launched
    busy_s: float  # of which not waiting for the other ranks: data, compute, optimizer
    vote: PendingVote
    lr: float = 0.0  # the step's learning rate (first parameter group)


@dataclass
class PassEnd:
    """How one pass over (the rest of) an epoch's batches ended, and what it waited for."""

    comm_wait_s: float = 0.0
    data_wait_s: float = 0.0
    eval_s: float = 0.0  # evaluations in the middle of the pass (trainer.eval_every): not training time
    stopped_by: str | None = None
    rollback: list[int] | None = None  # the bad range to skip after rolling back


@dataclass(frozen=True)
class EpochEnd:
    """The figures of the last evaluated epoch, as FitResult reports them."""

    loss: float = float("nan")
    val: dict[str, float] = field(default_factory=dict)  # the validation: "loss" and the task's metrics, means per sample
    samples_per_s: float = 0.0
    step_ms: float = 0.0
    comm_wait_ms: float = 0.0


@dataclass
class Loop:
    """Everything a run is made of once built; fit() drives it pass by pass."""

    cfg: FitConfig
    comm: Collectives
    run: RunContext
    model: nn.Module
    sync: GradientSync
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    sampler: ShardSampler
    accumulation: int
    task: Task
    train: MapDataset
    val: MapDataset
    held_out: MapDataset | None  # the task's test split: evaluated once, when training is complete
    model_config: dict[str, Any]
    boundary: StepBoundary  # the stop vote, the save handshake, saving: as in the run handle
    progress: Progress
    resumed_from: int | None
    guard: BadStepGuard
    watch: StragglerWatch
    autocast_dtype: torch.dtype | None = None
    metric_names: tuple[str, ...] | None = None  # the task's metric sums, named by the first step
    read_on_training_thread_said: bool = False  # the one line saying so is logged
    loader: WorkerLoader | None = None  # data.workers > 0: the processes reading batches
    metrics: MetricsWriter = field(default_factory=lambda: MetricsWriter(None))  # metrics.jsonl (rank 0)
    train_module: nn.Module | None = None  # what the training step runs: the synced module, compiled with trainer.compile
    in_flight: InFlight | None = None  # the newest step, its sums not read yet

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def coordinator(self) -> SaveCoordinator | None:
        return self.boundary.coordinator

    def more_to_train(self) -> bool:
        max_steps = self.cfg.trainer.max_steps
        return self.progress.epoch <= self.cfg.trainer.epochs and not (max_steps is not None and self.progress.step >= max_steps)

    def train_pass(self) -> PassEnd:
        """Train from the data position until the epoch's data ends or a step says to stop."""
        started, progress = time.perf_counter(), self.progress
        self.run.stop.phase = "training"
        self.optimizer.zero_grad()  # set_to_none by default (Horovod's wrapper takes no arguments)
        skip_past(progress)  # data of rolled-back steps is never trained on again
        ended = PassEnd()
        batches = self.batches(self.sampler.batches(progress.epoch, start=progress.position))
        step = LocalStep(batches.wait_s)
        try:
            for micro, items in enumerate(batches, start=1):
                self.forward_backward(step, items, last=micro % self.accumulation == 0)
                if micro % self.accumulation:
                    continue  # accumulation micro-step: gradients stay local
                if self.after_step(self.finish_step(step, batches.wait_s, ended), ended):
                    break
                step = LocalStep(batches.wait_s)  # after saves and evaluations: a step's time is its own
            else:  # the epoch's data ended: the last step's sums decide as any step's do
                if self.in_flight is not None:
                    self.decide([self.read(self.in_flight)], ended)
        finally:
            self.in_flight = None
            batches.close()
        ended.data_wait_s += batches.wait_s
        self.progress.epoch_seconds += time.perf_counter() - started - ended.eval_s
        return ended

    def batches(self, indices: Iterator[np.ndarray]) -> Prefetcher | Pass:
        """The pass's batches read ahead: on worker processes (data.workers), started at the first
        pass and kept for the run, or on a thread. A task's own data set may draw random numbers
        (transforms): each batch is read in a stream of its own (trainers/rngstreams.py), and with
        data.workers=0 on the training thread, whose stream a reading thread would share."""
        page_locked = pin if self.device.type == "cuda" else None
        data, seed, rank, epoch = self.cfg.data, self.cfg.trainer.seed, self.comm.rank, self.progress.epoch
        if data.workers == 0:
            if not getattr(self.train, "draws_random", True):
                return Prefetcher(lambda rows: read_items(self.train, rows), indices, depth=data.prefetch, pin=page_locked)

            if not self.read_on_training_thread_said:
                self.read_on_training_thread_said = True
                log.info(
                    "data.workers=0: %s is read on the training thread, each batch in its own random stream (no read-ahead); "
                    "data.workers>=1 reads ahead on processes, or give the class draws_random = False if reading draws no random numbers",
                    type(self.train).__name__,
                )

            def read_in_own_stream(rows: np.ndarray) -> Any:
                with rngstreams.isolated(rngstreams.batch_seed(seed, rank, epoch, rows)):
                    return read_items(self.train, rows)

            return Prefetcher(read_in_own_stream, indices, depth=0, pin=page_locked)
        if self.loader is None:
            collate = getattr(self.task, "collate_where_read", lambda: None)()  # a user task's items: collated in the worker
            self.loader = WorkerLoader(self.train, data.workers, data.batch_size, data.prefetch, streams=(seed, rank), collate=collate)
        following = (lambda: self.sampler.batches(epoch + 1)) if epoch < self.cfg.trainer.epochs else None  # read while this epoch ends
        return self.loader.epoch(indices, pin=page_locked, epoch=epoch, start=self.progress.position, following=following)

    def forward_backward(self, step: LocalStep, items: Any, last: bool) -> None:
        batch = self.task.batch(items, self.device)
        with self.sync.micro_step(last=last):  # no communication on micro-steps
            with torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext():
                out = self.task.train_step(self.sync.module if self.train_module is None else self.train_module, batch)
            check_loss(out)
            self.scaler.scale(out.loss / self.accumulation if self.accumulation > 1 else out.loss).backward()
        step.add(out)

    def finish_step(self, step: LocalStep, data_wait_s: float, ended: PassEnd) -> InFlight:
        """Average the gradients, update (skipped on the device where they are not finite), count
        the step and launch the sum of its figures over the ranks, read by the next step."""
        synced_at = time.perf_counter()
        ended.comm_wait_s -= self.sync.comm_wait_s
        self.sync.synchronize()  # averaged gradients, before unscaling or clipping them
        ended.comm_wait_s += self.sync.comm_wait_s
        optimizer_at = time.perf_counter()
        update = self.update()
        progress = self.progress
        progress.step += 1
        progress.epoch_steps += 1
        position_before = progress.position
        progress.position += self.accumulation * self.sampler.global_batch
        # The step's time split; data wait is what the prefetcher made this rank wait.
        done_at, data_s = time.perf_counter(), data_wait_s - step.data_wait_before
        phases = (data_s, synced_at - step.started - data_s, optimizer_at - synced_at, done_at - optimizer_at)
        reported = tuple(sorted(step.sums))
        if self.metric_names is None:  # agreed by every rank at its first step, one exchange
            self.metric_names = metricnames.agree(self.comm, reported, "the first step")
        vote = self.boundary.launch(progress.step, reported, step.values(phases, update, self.metric_names), overlap=False)
        self.boundary.stepped(progress.step, self.resumed_from)
        busy_s = phases[0] + phases[1] + phases[3]
        return InFlight(progress.step, position_before, progress.position, time.perf_counter() - step.started, busy_s, vote, update.lr)

    def update(self) -> Update:
        """The optimizer step on averaged gradients, skipped where they are not finite; the
        step's non-finite flag and gradient norm (tensors on the device: read with the step's sums)."""
        scaler = self.scaler
        lr = host_number(self.optimizer.param_groups[0]["lr"])  # the schedule's, before it steps
        scaler.unscale_(self.optimizer)
        # fp16: the scaler skips such steps itself, and lowers its scale (not a bad step)
        nonfinite = 0.0 if scaler.is_enabled() else self.sync.nonfinite(self.model)
        grad_norm: torch.Tensor | float = 0.0
        if self.cfg.trainer.clip_grad_norm is not None:  # the global norm, also over sharded gradients (a skipped step's are dropped)
            grad_norm = self.sync.clip_grad_norm_(self.model, self.cfg.trainer.clip_grad_norm)
        if self.coordinator is not None:
            self.coordinator.fence()  # an asynchronous save still copying what this step changes
        with self.sync.step_context():
            if isinstance(nonfinite, torch.Tensor):
                step_unless(self.optimizer, nonfinite)
            else:
                scaler.step(self.optimizer)  # skipped (and the scale lowered) on inf/nan gradients in fp16
        scaler.update()
        self.schedule.step()
        self.optimizer.zero_grad()
        return Update(nonfinite, grad_norm, lr)

    def read(self, flight: InFlight) -> StepSums:
        """A step's sums over the ranks (the step's one wait for the device), and its bookkeeping:
        a non-finite step counted, the epoch's sums, the step's record."""
        began = time.perf_counter()
        sums = StepSums.of(self.boundary.settle(flight.vote, expected=self.metric_names))
        step_s = flight.host_s + time.perf_counter() - began
        finite = sums.nonfinite == 0
        progress = self.progress
        self.guard.record(finite, progress, flight.position_before, flight.position_after)
        progress.epoch_loss_sum += sums.loss if finite else 0.0  # global sums: the same on every rank, so
        progress.epoch_seen += int(sums.seen)  # rank 0's checkpoint restores them all
        self.report_step(flight, sums, finite, step_s)
        return sums

    def report_step(self, flight: InFlight, sums: StepSums, finite: bool, step_s: float) -> None:
        progress, seen, step = self.progress, max(sums.seen, 1), flight.step
        record: dict[str, Any] = {
            "step": step,
            "epoch": progress.epoch,
            "loss": sums.loss / seen,
            **{name: value / seen for name, value in zip(self.metric_names or (), sums.metrics, strict=True)},
            "samples_per_s": sums.seen / step_s,
            "step_ms": 1000 * step_s,
            "bad_steps": progress.bad_steps,
            "rollbacks": progress.rollbacks,
            "lr": flight.lr,
            **({"grad_norm": sums.grad_norm / self.comm.world_size} if self.cfg.trainer.clip_grad_norm is not None else {}),
            **{f"{name}_ms": 1000 * value / self.comm.world_size for name, value in zip(PHASES, sums.phases, strict=True)},
        }
        if not finite:
            record["skipped"] = True
            log.warning(
                "step %d: non-finite gradients (loss %g): update skipped (%d in a row, %d in all)",
                step,
                record["loss"],
                self.guard.in_a_row,
                progress.bad_steps,
            )
        # Compared: the time a rank was busy (not waiting for the others in a collective,
        # which every rank does until the slowest arrives, so step times come out equal).
        straggler = self.watch.step(step, flight.busy_s)
        if straggler is not None:
            log.warning("%s", straggler.line())
            record["straggler"] = {"rank": straggler.rank, "host": straggler.host, "step_ms": straggler.step_ms, "median_ms": straggler.median_ms}
        self.run.steps.report(record)

    def after_step(self, flight: InFlight, ended: PassEnd) -> bool:
        """With step k queued, read step k-1's sums; where they or the host's own counts call
        for anything, step k's too, then decide as one (the same on every rank). True ends the pass."""
        earlier, self.in_flight = self.in_flight, flight
        read = [self.read(earlier)] if earlier is not None else []
        if not self.must_decide(flight.step, read):
            return False
        read.append(self.read(flight))
        self.in_flight = None
        return self.decide(read, ended)

    def must_decide(self, step: int, read: list[StepSums]) -> bool:
        """Whether anything is to be done after `step`: the host's counts (max_steps, a range to
        skip, an evaluation or a save by step count) or the sums read (a stop, a timed save, a rollback)."""
        every, max_steps = self.cfg.trainer.eval_every, self.cfg.trainer.max_steps
        return (
            (max_steps is not None and step >= max_steps)
            or self.guard.must_roll_back
            or self.skip_starts_here()
            or bool(every and step % every == 0)
            or any(sums.vote.stop_votes > 0 for sums in read)
            or self.boundary.save_due(step, read[-1].vote if read else None)
        )

    def decide(self, read: list[StepSums], ended: PassEnd) -> bool:
        """What the sums read decide, once every step's are read; True ends the pass."""
        progress, max_steps = self.progress, self.cfg.trainer.max_steps
        votes = [sums.vote for sums in read]
        ended.stopped_by = next((stop for vote in votes if (stop := self.boundary.stopped_by(vote))), None)
        if ended.stopped_by:
            return True
        if max_steps is not None and progress.step >= max_steps:
            return True
        if self.guard.must_roll_back:
            ended.rollback = self.guard.bad_range(progress)
            return True
        if self.skip_starts_here():
            return True  # a range to skip starts here: fit() starts a new pass past it
        every = self.cfg.trainer.eval_every
        if every and progress.step % every == 0 and self.epoch_unfinished():  # an epoch's end evaluates anyway
            began = time.perf_counter()
            self.evaluate_midway()
            ended.eval_s += time.perf_counter() - began
        if any(self.boundary.save_due(progress.step, vote) for vote in votes):
            self.save(synchronous=False)
        return False

    def skip_starts_here(self) -> bool:
        progress = self.progress
        return any(e == progress.epoch and start == progress.position for e, start, _ in progress.skip)

    def evaluate_midway(self) -> None:
        """trainer.eval_every: the validation figures in the middle of an epoch, reported as at
        an epoch's end (metrics.jsonl, val/ scalars), and kept if best (checkpoint.best)."""
        progress = self.progress
        val = self.evaluate()
        self.run.stop.phase = "training"
        log.info("step %d (epoch %d)  %s", progress.step, progress.epoch, figures_line("val", val))
        self.report_validation(val)
        figures = {f"val_{name}": value for name, value in val.items()}
        self.metrics.write({"epoch": progress.epoch, "step": progress.step, **figures, "world_size": self.comm.world_size})
        self.keep_if_best(val)

    def report_validation(self, val: dict[str, float]) -> None:
        self.run.steps.figures({f"val/{name}": value for name, value in val.items()}, self.progress.step)

    def keep_if_best(self, val: dict[str, float]) -> None:
        """checkpoint.best: when this validation improves the figure, a checkpoint of this step is
        saved (synchronously) and kept beside the newest ones."""
        name, coordinator = self.cfg.checkpoint.best, self.coordinator
        if name is None or coordinator is None:
            return
        figure = name.removeprefix("val_")
        if figure not in val:
            reported = ", ".join(f"val_{k}" for k in sorted(val))
            raise TaskError(f"checkpoint.best={name}: the validation reports no such figure (it reports {reported})")
        value, best, lower = val[figure], coordinator.checkpointer.best, self.cfg.checkpoint.best_mode == "min"
        if not math.isfinite(value):
            return
        if best is not None and best.get("metric") == name and (value >= best["value"] if lower else value <= best["value"]):
            return
        self.save(synchronous=True)
        coordinator.checkpointer.mark_best(self.progress.step, name, value, self.cfg.checkpoint.best_mode)
        log.info("step %d: the best %s so far (%.4f): its checkpoint is kept", self.progress.step, name, value)

    def roll_back_past(self, bad_range: list[int]) -> None:
        """To the newest committed checkpoint; the bad range is never trained on again."""
        before = self.progress
        self.progress = roll_back(self.comm, self.coordinator, self.model, self.optimizer, self.schedule, self.scaler, before, bad_range)
        if self.progress is before:  # no checkpoint to go back to: the range is skipped, training goes on
            self.guard.reset()
        else:
            self.guard.rolled_back(self.progress.step)

    def in_skipped_range(self) -> bool:
        progress = self.progress
        return any(e == progress.epoch and start <= progress.position < end for e, start, end in progress.skip)

    def epoch_unfinished(self) -> bool:
        """Another step's data is left in this epoch (max_steps stopped the pass)."""
        step_samples = self.accumulation * self.sampler.global_batch
        return self.progress.position + step_samples <= self.sampler.steps_per_epoch * self.sampler.global_batch

    def end_epoch(self, ended: PassEnd) -> EpochEnd:
        """Evaluate, and report the epoch's figures (the same on every rank)."""
        progress, comm = self.progress, self.comm
        # Throughput is set by the slowest rank: every rank reports that one figure.
        slowest = torch.tensor([progress.epoch_seconds, ended.comm_wait_s, ended.data_wait_s], dtype=torch.float64)
        comm.allreduce_(slowest, op="max")
        epoch_seconds, waited, data_waited = slowest.tolist()
        progress.train_seconds += epoch_seconds
        steps = max(progress.epoch_steps, 1)
        peaks = peaks_over_ranks(comm)
        figures = EpochEnd(
            loss=progress.epoch_loss_sum / max(progress.epoch_seen, 1),
            val=self.evaluate(),
            samples_per_s=progress.epoch_seen / epoch_seconds if epoch_seconds > 0 else 0.0,
            step_ms=1000 * epoch_seconds / steps,
            comm_wait_ms=1000 * waited / steps,
        )
        validated = figures_line("val", figures.val)
        tokens = getattr(self.task, "tokens_per_sample", None)  # a token task's throughput in its own unit too
        rate = f"samples/s {figures.samples_per_s:.0f}" + (f"  tokens/s {figures.samples_per_s * tokens:.0f}" if tokens else "")
        memory = f"peak memory {max(peaks):.0f} MiB (rank {peaks.index(max(peaks))})"
        log.info("epoch %d/%d  loss %.4f  %s  %s  %s", progress.epoch, self.cfg.trainer.epochs, figures.loss, validated, rate, memory)
        self.report_validation(figures.val)
        self.metrics.write(
            {
                "epoch": progress.epoch,
                "step": progress.step,
                "loss": figures.loss,
                **{f"val_{name}": value for name, value in figures.val.items()},
                "samples_per_s": figures.samples_per_s,
                **({"tokens_per_s": figures.samples_per_s * tokens} if tokens else {}),
                "step_ms": figures.step_ms,
                "comm_wait_ms": figures.comm_wait_ms,
                "data_wait_ms": 1000 * data_waited / steps,
                "world_size": comm.world_size,
                "peak_memory_mib": peaks,
            }
        )
        self.keep_if_best(figures.val)
        return figures

    def stop_agreed(self) -> str | None:
        """Before the first step: whether any rank was asked to stop during start-up or resume."""
        return self.boundary.stop_agreed()

    def evaluate(self, data: MapDataset | None = None) -> dict[str, float]:
        """The validation split's figures (or `data`'s), the same on every rank."""
        self.run.stop.phase = "evaluation"
        average_buffers(self.comm, self.model)
        data = self.val if data is None else data
        lockstep = self.cfg.comm.sharding == "full"
        return self.task.summarize(evaluate(self.task, self.model, data, self.comm, self.cfg.data.eval_batch_size, self.device, lockstep))

    def test_once(self) -> tuple[dict[str, float], int | None]:
        """The held-out test split's figures, for a run whose training is complete ({} without
        one), and the step whose weights they are of: checkpoint.best's (loaded now: the run's
        last act, after its final save), else the final weights'."""
        if self.held_out is None:
            return {}, None
        best = self.load_best_for_test()
        figures = self.evaluate(self.held_out)
        weights = "the final weights" if best is None else f"the best checkpoint (step {best['step']}, {best['metric']} {best['value']:.4g})"
        log.info("held-out test split, evaluated once on %s: %s", weights, figures_line("test", figures))
        self.run.steps.figures({f"test/{name}": value for name, value in figures.items()}, self.progress.step)
        return figures, self.progress.step if best is None else int(best["step"])

    def load_best_for_test(self) -> dict[str, Any] | None:
        """checkpoint.best's record, its weights loaded into the model, where it is another step's
        than the final weights' (None: test those)."""
        name, coordinator = self.cfg.checkpoint.best, self.coordinator
        if name is None or coordinator is None or not self.cfg.checkpoint.test_best:
            return None
        best = coordinator.checkpointer.best
        if not best or best.get("metric") != name or best["step"] == self.progress.step:
            return None
        coordinator.fence()
        step, shared, own = coordinator.checkpointer.load_step(int(best["step"]))
        agree_on_newest(self.comm, step)  # every rank tests the same weights
        restore(self.model, self.optimizer, self.schedule, step, shared, self.scaler, own, lambda: coordinator.checkpointer.rank_states(step))
        return best

    def save(self, synchronous: bool) -> None:
        if self.coordinator is None:  # checkpoints off: nothing to snapshot
            return
        self.boundary.save(
            self.progress.step,
            lambda: shared_state(self.model, self.optimizer, self.schedule, self.progress, self.model_config, self.run.config_text, self.scaler),
            lambda: {"rng": rng_state(), **own_state(self.model, self.optimizer)},
            synchronous,
            later=self.stepped_tensors(),
        )

    def stepped_tensors(self) -> Callable[[torch.Tensor], bool]:
        """Whether a tensor of the state is a parameter or optimizer state: only the optimizer
        step changes those (buffers change in forward, and are copied at once)."""
        live = {p.data_ptr() for p in self.model.parameters()}
        live |= {t.data_ptr() for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)}
        return lambda tensor: tensor.numel() > 0 and tensor.data_ptr() in live

    def close(self, ended_as: str = "FINISHED") -> None:
        """`ended_as`: FINISHED, STOPPED (to resume later) or FAILED, for the metrics sinks."""
        if self.loader is not None:
            self.loader.close()
        self.boundary.close()
        for data in (self.train, self.val, self.held_out):
            close = getattr(data, "close", None)  # a data set holding a file
            if close is not None:
                close()
        self.sync.close()
        self.run.steps.close(ended_as)
        self.metrics.close()


def apply_deterministic_kernels() -> None:
    """Kernels whose results do not depend on scheduling (GPU atomics, autotuning), before the
    first cuBLAS call: CUBLAS_WORKSPACE_CONFIG is read when cuBLAS starts. An op torch has no
    deterministic kernel for (some pooling backwards on CUDA) warns, naming itself, and runs.
    The settings are the process's: they stay for the rest of it (a rank trains once)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def build_loop(cfg: FitConfig, comm: Collectives, task: Task, run: RunContext, metrics: MetricsWriter | None = None) -> Loop:
    """Model, optimizer, schedule, gradient sync and data, resumed from the newest checkpoint."""
    model = placed_model(cfg, comm, task)
    accumulation = accumulation_steps(cfg.trainer, cfg.data.batch_size, comm.world_size)
    global_batch = accumulation * cfg.data.batch_size * comm.world_size
    optimizer = build_optimizer(cfg.optim, task.param_groups(model), scaled_lr(cfg.optim, global_batch))
    sync = build_gradient_sync(model, optimizer, comm, cfg.comm, accumulation)
    optimizer = sync.optimizer
    # Compiled for training only: evaluation's eval mode would compile a second graph. The state
    # saved is the plain model's (no `_orig_mod.` prefix), so a resume may switch compile.
    train_module = compiled(sync.module, cfg.trainer.compile_backend) if cfg.trainer.compile else None
    scaler = torch.amp.GradScaler(comm.device.type, enabled=cfg.trainer.precision == "fp16")
    train, val, held_out = checked_data_sets(task, comm)
    sampler = ShardSampler(len(train), cfg.data.batch_size, comm.rank, comm.world_size, cfg.trainer.seed)
    steps_per_epoch = max(1, sampler.steps_per_epoch // accumulation)
    total_steps = min(cfg.trainer.max_steps or 1 << 62, cfg.trainer.epochs * steps_per_epoch)
    schedule = build_schedule(cfg.optim, optimizer, total_steps)
    task_target = str(task.describe().get("task") or f"{type(task).__module__}.{type(task).__qualname__}")
    run.stop.phase = "resume"
    load_began = time.time()
    rngstreams.seed_rank(cfg.trainer.seed, comm.rank)  # its own stream from here on (a checkpoint's, if resumed)
    coordinator, progress, resumed_from = resume_or_start(cfg.checkpoint, run.checkpoint_dir, comm, model, optimizer, schedule, scaler, task_target)
    run.milestones.loaded(load_began, time.time())
    plan = f"{comm.world_size} ranks x batch {cfg.data.batch_size} x {accumulation} micro-batches, {steps_per_epoch} steps per epoch"
    log_training_plan(cfg, task, (train, val, held_out), plan, global_batch, optimizer.param_groups[0]["initial_lr"], train_module is not None)
    run.steps.total_steps = total_steps if total_steps < 1 << 62 else None
    return Loop(
        cfg,
        comm,
        run,
        model,
        sync,
        optimizer,
        schedule,
        scaler,
        sampler,
        accumulation,
        task,
        train,
        val,
        held_out,
        model_config=task.describe(),
        boundary=StepBoundary(comm, run.stop, coordinator, run.watchdog, run.milestones),
        progress=progress,
        resumed_from=resumed_from,
        guard=BadStepGuard(cfg.trainer.max_bad_steps),
        watch=StragglerWatch(comm, run.host, cfg.trainer.straggler_every, cfg.trainer.straggler_ratio),
        autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.trainer.precision),
        metrics=metrics or MetricsWriter(None),
        train_module=train_module,
    )


def placed_model(cfg: FitConfig, comm: Collectives, task: Task) -> nn.Module:
    """The task's model on this rank's device, the same on every rank, as the trainer settings
    shape it (SyncBatchNorm, channels_last, recomputation in backward) and sharded for
    comm.sharding=full, before any optimizer sees its parameters."""
    task.set_place(Place(comm.rank, comm.world_size, comm.device))
    torch.manual_seed(cfg.trainer.seed)
    if cfg.trainer.deterministic:
        apply_deterministic_kernels()
    memory_format = torch.channels_last if cfg.trainer.channels_last else torch.contiguous_format  # 4-D parameters only
    model = task.build_model()
    if cfg.trainer.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(comm.device, memory_format=memory_format)  # type: ignore[call-overload]  # torch stubs lack memory_format
    if cfg.trainer.activation_checkpointing:
        recompute_in_backward(task.checkpointed_modules(model))
    broadcast_module(comm, model)  # identical start on every rank, whatever their seeds did
    if cfg.comm.sharding == "full":  # before the optimizer: FSDP2 replaces the parameters with their shards
        model = shard_model(model, sharding_units(task, model))
    return model


def checked_data_sets(task: Task, comm: Collectives) -> tuple[MapDataset, MapDataset, MapDataset | None]:
    """The task's training, validation and (optional) test sets, checked alike on every rank."""
    train, val, held_out = task.train_data(), task.eval_data(), task.test_data()
    check_data_sets(train, val, comm)
    if held_out is not None:
        check_data_sets(train, held_out, comm, "test")
    return train, val, held_out


def log_training_plan(
    cfg: FitConfig, task: Task, data_sets: tuple[MapDataset, MapDataset, MapDataset | None], plan: str, global_batch: int, lr: float, is_compiled: bool
) -> None:
    """The one line that says what this run trains, on what, and how its gradients travel."""
    train, val, held_out = data_sets
    comm = cfg.comm
    log.info(
        "training %s: %d train / %d validation%s samples, %s, comm %s (allreduce %s, buckets %.1f MiB, overlap %s, compression %s%s), "
        "global batch %d, lr %g, precision %s%s",
        task_name(task),
        len(train),
        len(val),
        f" / {len(held_out)} test" if held_out is not None else "",
        plan,
        comm.backend,
        comm.algorithm,
        comm.bucket_mb,
        comm.overlap,
        comm.compression,
        f", sharding {comm.sharding}" if comm.sharding != "none" else "",
        global_batch,
        lr,
        cfg.trainer.precision,
        ", compiled" if is_compiled else "",
    )


def sharding_units(task: Task, model: nn.Module) -> list[nn.Module]:
    """What comm.sharding=full shards one by one: the task's checkpointed_modules (a transformer's
    blocks) where it names them; else the model as one unit."""
    try:
        return list(task.checkpointed_modules(model) or [])
    except TaskError:
        return []


def compiled(module: nn.Module, backend: str) -> nn.Module:
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        raise TaskError(f"trainer.compile_backend={backend!r} is not a torch.compile backend here; one of {', '.join(sorted(known))}")
    return cast(nn.Module, torch.compile(module, backend=backend))  # an OptimizedModule


def figures_line(split: str, figures: dict[str, float]) -> str:
    """`val_loss 0.1234  val_accuracy 0.9500`: a split's figures for the log, its loss first."""
    return "  ".join(f"{split}_{name} {four_places(value)}" for name, value in sorted(figures.items(), key=lambda kv: kv[0] != "loss"))


def task_name(task: Task) -> str:
    """`mlp (classify), 10 classes`: the model, the task, and a classifier's class count (labels
    0..10 make 11 classes, said where a user looks, not left to be found in the model's shape)."""
    described = task.describe()
    classes = f", {described['num_classes']} classes" if isinstance(described.get("num_classes"), int) else ""
    return f"{described.get('name', '?')} ({described.get('task', type(task).__name__)}){classes}"


def check_data_sets(train: MapDataset, evaluated: MapDataset, comm: Collectives, split: str = "validation") -> None:
    """Every rank must see the same data sets (lengths agree), and evaluation must give every
    rank at least one sample (the ranks learn the metric names from their first batch)."""
    lengths = torch.tensor([len(train), -len(train), len(evaluated), -len(evaluated)], dtype=torch.float64)
    comm.allreduce_(lengths, op="max")
    if lengths[0] != -lengths[1] or lengths[2] != -lengths[3]:
        raise TaskError(
            f"ranks see data sets of different lengths (train {int(-lengths[1])}..{int(lengths[0])}, "
            f"{split} {int(-lengths[3])}..{int(lengths[2])}); every rank must build the same data"
        )
    if len(evaluated) < comm.world_size:
        raise TaskError(f"the {split} data set has {len(evaluated)} samples, fewer than the {comm.world_size} ranks; give it at least one per rank")


def check_loss(out: StepOutput) -> None:
    loss = out.loss
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.dtype.is_floating_point:
        shown = f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor) else f"a tensor of shape {tuple(loss.shape)}"
        raise TaskError(f"the training step returned {shown} as its loss; return the batch's mean loss as a scalar float tensor")
