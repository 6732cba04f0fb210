"""One run once built (`Loop`): passes over the data, the step and its bookkeeping, evaluation at
the end of an epoch, rollback after non-finite steps, and saving. Its parts are the engine (model,
sync, optimizer: trainers.loop.engine), the data plan (splits, sampler, readers:
trainers.loop.dataplan) and the step policies (stop, save, rollback, stragglers:
trainers.loop.policies); trainers.loop.fit drives it, trainers.loop.build makes it.

A step reads one thing back from the device: its sums (loss, non-finite flag, metric sums, the
votes), and it reads them a step late, once the next step is queued, so a GPU always has the next
step's work while the host waits. A non-finite step is skipped on the device (trainers.optim.
step_unless) and counted when its sums are read; whatever the sums decide (stop, save, roll back)
every rank decides at the same step, because every rank reads the same sums at the same point."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from collectives.base import Collectives
from trainers.checkpoint.recovery import agree_on_newest, roll_back
from trainers.checkpoint.registry import Registry, own_checkpoint, restore_checkpoint, shared_checkpoint
from trainers.checkpoint.saving import SaveCoordinator
from trainers.checkpoint.state import Progress
from trainers.context import FitConfig, RunContext
from trainers.data.loader import Pass
from trainers.data.reading import Prefetcher
from trainers.evaluation import average_buffers, evaluate
from trainers.guard import in_skipped_range, skip_past
from trainers.loop.dataplan import DataPlan
from trainers.loop.engine import Engine
from trainers.loop.policies import StepPolicies
from trainers.loop.records import EpochEnd, LocalStep, PassEnd, StepInFlight, StepSums
from trainers.reporting import metricnames
from trainers.reporting.memory import peaks_over_ranks
from trainers.reporting.reporter import PHASES, four_places
from trainers.task import MapDataset, Task, TaskError

log = logging.getLogger("trainers")


@dataclass
class Loop:
    """Everything a run is made of once built; fit() drives it pass by pass."""

    cfg: FitConfig
    comm: Collectives
    run: RunContext
    task: Task
    engine: Engine
    data: DataPlan
    policies: StepPolicies
    progress: Progress
    registry: Registry  # what a checkpoint keeps: model, optimizer, schedule, scaler, progress (trainers.checkpoint.registry)
    resumed_from: int | None
    model_config: dict[str, Any]  # the task's description; its "task" names what a checkpoint may resume
    metric_names: tuple[str, ...] | None = None  # the task's metric sums, named by the first step
    in_flight: StepInFlight | None = None  # the newest step, its sums not read yet

    @property
    def device(self) -> torch.device:
        return self.comm.device

    @property
    def coordinator(self) -> SaveCoordinator | None:
        return self.policies.boundary.coordinator

    def more_to_train(self) -> bool:
        return self.progress.epoch <= self.cfg.trainer.epochs and not self.policies.at_max_steps(self.progress.step)

    def train_pass(self) -> PassEnd:
        """Train from the data position until the epoch's data ends or a step says to stop."""
        started, progress = time.perf_counter(), self.progress
        self.run.stop.phase = "training"
        self.engine.optimizer.zero_grad()  # set_to_none by default (Horovod's wrapper takes no arguments)
        skip_past(progress)  # data of rolled-back steps is never trained on again
        ended = PassEnd()
        batches = self.batches()
        step, engine = LocalStep(batches.wait_s), self.engine
        try:
            for micro, items in enumerate(batches, start=1):
                batch = self.task.batch(items, self.device)
                step.add(engine.forward_backward(self.task, batch, last=micro % engine.accumulation == 0))
                if micro % engine.accumulation:
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

    def batches(self) -> Prefetcher | Pass:
        """The pass's batches, read ahead from the data position (trainers.loop.dataplan)."""
        cfg = self.cfg
        streams = (cfg.trainer.seed, self.comm.rank)
        return self.data.batches(self.task, cfg.data, streams, self.device, cfg.trainer.epochs, self.progress)

    def finish_step(self, step: LocalStep, data_wait_s: float, ended: PassEnd) -> StepInFlight:
        """Average the gradients, update (skipped on the device where they are not finite), count
        the step and launch the sum of its figures over the ranks, read by the next step."""
        synced_at = time.perf_counter()
        sync = self.engine.sync
        ended.comm_wait_s -= sync.comm_wait_s
        sync.synchronize()  # averaged gradients, before unscaling or clipping them
        ended.comm_wait_s += sync.comm_wait_s
        optimizer_at = time.perf_counter()
        update = self.engine.update(self.coordinator)
        progress = self.progress
        progress.step += 1
        progress.epoch_steps += 1
        position_before = progress.position
        progress.position += self.data.step_samples
        # The step's time split; data wait is what the prefetcher made this rank wait.
        done_at, data_s = time.perf_counter(), data_wait_s - step.data_wait_before
        phases = (data_s, synced_at - step.started - data_s, optimizer_at - synced_at, done_at - optimizer_at)
        reported = tuple(sorted(step.sums))
        if self.metric_names is None:  # agreed by every rank at its first step, one exchange
            self.metric_names = metricnames.agree(self.comm, reported, "the first step")
        boundary = self.policies.boundary
        vote = boundary.launch(progress.step, reported, step.values(phases, update, self.metric_names), overlap=False)
        boundary.stepped(progress.step, self.resumed_from)
        busy_s = phases[0] + phases[1] + phases[3]
        return StepInFlight(progress.step, position_before, progress.position, time.perf_counter() - step.started, busy_s, vote, update.lr)

    def read(self, flight: StepInFlight) -> StepSums:
        """A step's sums over the ranks (the step's one wait for the device), and its bookkeeping:
        a non-finite step counted, the epoch's sums, the step's record."""
        began = time.perf_counter()
        sums = StepSums.of(self.policies.boundary.settle(flight.vote, expected=self.metric_names))
        step_s = flight.host_s + time.perf_counter() - began
        finite = sums.nonfinite == 0
        progress = self.progress
        self.policies.guard.record(finite, progress, flight.position_before, flight.position_after)
        progress.epoch_loss_sum += sums.loss if finite else 0.0  # global sums: the same on every rank, so
        progress.epoch_seen += int(sums.seen)  # rank 0's checkpoint restores them all
        self.report_step(flight, sums, finite, step_s)
        return sums

    def report_step(self, flight: StepInFlight, sums: StepSums, finite: bool, step_s: float) -> None:
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
                self.policies.guard.in_a_row,
                progress.bad_steps,
            )
        # Compared: the time a rank was busy (not waiting for the others in a collective,
        # which every rank does until the slowest arrives, so step times come out equal).
        straggler = self.policies.watch.step(step, flight.busy_s)
        if straggler is not None:
            log.warning("%s", straggler.line())
            record["straggler"] = {"rank": straggler.rank, "host": straggler.host, "step_ms": straggler.step_ms, "median_ms": straggler.median_ms}
        self.run.steps.report(record)

    def after_step(self, flight: StepInFlight, ended: PassEnd) -> bool:
        """With step k queued, read step k-1's sums; where they or the host's own counts call
        for anything, step k's too, then decide as one (the same on every rank). True ends the pass."""
        earlier, self.in_flight = self.in_flight, flight
        read = [self.read(earlier)] if earlier is not None else []
        if not self.policies.must_decide(flight.step, self.progress, read):
            return False
        read.append(self.read(flight))
        self.in_flight = None
        return self.decide(read, ended)

    def decide(self, read: list[StepSums], ended: PassEnd) -> bool:
        """What the sums read decide, once every step's are read; True ends the pass."""
        policies, step, votes = self.policies, self.progress.step, [sums.vote for sums in read]
        if policies.ends_pass(votes, self.progress, ended):
            return True
        if policies.evaluates_at(step) and self.epoch_unfinished():  # an epoch's end evaluates anyway
            began = time.perf_counter()
            self.evaluate_midway()
            ended.eval_s += time.perf_counter() - began
        if policies.save_due(step, votes):
            self.save(synchronous=False)
        return False

    def evaluate_midway(self) -> None:
        """trainer.eval_every: the validation figures in the middle of an epoch, reported as at
        an epoch's end (metrics.jsonl, val/ scalars), and kept if best (checkpoint.best)."""
        progress = self.progress
        val = self.evaluate()
        self.run.stop.phase = "training"
        log.info("step %d (epoch %d)  %s", progress.step, progress.epoch, figures_line("val", val))
        figures = {f"val_{name}": value for name, value in val.items()}
        self.run.steps.moment({"epoch": progress.epoch, "step": progress.step, **figures, "world_size": self.comm.world_size})
        self.keep_if_best(val)

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
        guard = self.policies.guard
        if not roll_back(self.comm, self.coordinator, self.registry, self.progress, self.model_config["task"], bad_range):
            guard.skipped_without_checkpoint()  # no checkpoint to go back to: the range is skipped, training goes on
            return
        self.engine.optimizer.zero_grad()
        guard.rolled_back(self.progress.step)

    def in_skipped_range(self) -> bool:
        return in_skipped_range(self.progress)

    def epoch_unfinished(self) -> bool:
        """Another step's data is left in this epoch (max_steps stopped the pass)."""
        return self.data.epoch_unfinished(self.progress)

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
        self.run.steps.moment(
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
        return self.policies.boundary.stop_agreed()

    def evaluate(self, data: MapDataset | None = None) -> dict[str, float]:
        """The validation split's figures (or `data`'s), the same on every rank."""
        self.run.stop.phase = "evaluation"
        average_buffers(self.comm, self.engine.model)
        data = self.data.val if data is None else data
        lockstep = self.cfg.comm.sharding == "full"
        return self.task.summarize(evaluate(self.task, self.engine.model, data, self.comm, self.cfg.data.eval_batch_size, self.device, lockstep))

    def test_once(self) -> tuple[dict[str, float], int | None]:
        """The held-out test split's figures, for a run whose training is complete ({} without
        one), and the step whose weights they are of: checkpoint.best's (loaded now: the run's
        last act, after its final save), else the final weights'."""
        if self.data.held_out is None:
            return {}, None
        best = self.load_best_for_test()
        figures = self.evaluate(self.data.held_out)
        weights = "the final weights" if best is None else f"the best checkpoint (step {best['step']}, {best['metric']} {best['value']:.4g})"
        log.info("held-out test split, evaluated once on %s: %s", weights, figures_line("test", figures))
        self.run.steps.moment({"step": self.progress.step, **{f"test_{name}": value for name, value in figures.items()}})
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
        where = self.progress.state_dict()  # the run's own count stays: only the weights are the best step's
        restore_checkpoint(self.registry, step, shared, own, lambda: coordinator.checkpointer.rank_states(step), self.model_config["task"])
        self.progress.load_state_dict(where)
        return best

    def save(self, synchronous: bool) -> None:
        if self.coordinator is None:  # checkpoints off: nothing to snapshot
            return
        registry, step = self.registry, self.progress.step
        self.policies.boundary.save(
            step,
            lambda: shared_checkpoint(registry, step, self.comm.world_size, self.run.config_text, self.model_config),
            lambda: own_checkpoint(registry),
            synchronous,
            later=self.engine.stepped_tensors(),
        )

    def close(self, ended_as: str = "FINISHED") -> None:
        """`ended_as`: FINISHED, STOPPED (to resume later) or FAILED, for the metrics sinks."""
        self.data.close()
        self.policies.boundary.close()
        self.engine.sync.close()
        self.run.steps.close(ended_as)


def figures_line(split: str, figures: dict[str, float]) -> str:
    """`val_loss 0.1234  val_accuracy 0.9500`: a split's figures for the log, its loss first."""
    return "  ".join(f"{split}_{name} {four_places(value)}" for name, value in sorted(figures.items(), key=lambda kv: kv[0] != "loss"))
