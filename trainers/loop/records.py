"""What a step and a pass leave behind: this rank's figures of the step in progress (`LocalStep`),
the optimizer step's device values (`Update`), a finished step whose sums are on their way
(`StepInFlight`), the sums once read (`StepSums`: the stop vote and the save handshake as named
fields), and how a pass and an epoch ended (`PassEnd`, `EpochEnd`). Data only: the loop fills them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from trainers.boundary import PendingVote, StepVote
from trainers.reporting.reporter import PHASES
from trainers.task import StepOutput


@dataclass(frozen=True)
class StepSums:
    """A step's figures summed over the ranks; they ride on the step boundary's vote, in the
    order of `LocalStep.values` (the numbers the host knows first: they travel in one copy)."""

    seen: float  # samples
    phases: tuple[float, ...]  # seconds per PHASES entry, as the host saw them
    loss: float  # sum of per-sample losses
    nonfinite: float  # ranks whose averaged gradients were not finite (all or none)
    grad_norm: float  # the averaged gradients' global 2-norm before clipping, summed over the ranks (0 without clipping)
    metrics: tuple[float, ...]  # the task's metric sums, in the loop's metric_names order
    vote: StepVote

    @classmethod
    def of(cls, vote: StepVote) -> StepSums:
        seen, *rest = vote.values
        phases, (loss, nonfinite, grad_norm, *metrics) = rest[: len(PHASES)], rest[len(PHASES) :]
        return cls(seen, tuple(phases), loss, nonfinite, grad_norm, tuple(metrics), vote)


@dataclass(frozen=True)
class Update:
    """What the optimizer step leaves for the step's record: device values, read with its sums."""

    nonfinite: torch.Tensor | float  # 1 where the averaged gradients were not finite (the update skipped)
    grad_norm: torch.Tensor | float  # their global 2-norm before clipping (0.0 where nothing clips)
    lr: float  # the first parameter group's learning rate for this step


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


@dataclass(frozen=True)
class StepInFlight:
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
