"""Fit y = a x + b through noisy points: a complete task for hpc-toolkit (see ../README.md)."""

from __future__ import annotations

import torch
from torch import nn

from trainers.task import StepOutput


class Points(torch.utils.data.Dataset):
    """Map-style: the toolkit's sampler asks for items by index, so it owns the data position."""

    def __init__(self, n: int, slope: float, intercept: float, noise: float, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = 4 * torch.rand(n, 1, generator=generator) - 2
        self.y = slope * self.x + intercept + noise * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


class LineFit:
    def __init__(self, slope: float = 3.0, intercept: float = -1.0, noise: float = 0.05, samples: int = 2048) -> None:
        self.slope, self.intercept, self.noise, self.samples = slope, intercept, noise, samples

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def train_data(self) -> Points:
        return Points(self.samples, self.slope, self.intercept, self.noise, seed=1)

    def eval_data(self) -> Points:
        return Points(256, self.slope, self.intercept, self.noise, seed=2)

    def train_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        x, y = batch
        error = model(x) - y
        within = (error.abs() < 3 * self.noise).sum()  # predictions within three noise widths
        return StepOutput(loss=(error**2).mean(), count=len(x), sums={"within_3_sigma": float(within)})

    def eval_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        return self.train_step(model, batch)

    def describe(self) -> dict[str, float | str]:
        return {"name": "linefit", "slope": self.slope, "intercept": self.intercept}
