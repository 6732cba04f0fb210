"""Classification on an HDF5 data set (trainers.datasets): a built-in model (mlp, cnn,
resnet50), cross-entropy loss, and accuracy as the metric."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from trainers.config import DataConfig, ModelConfig, TrainerConfig
from trainers.data import H5Split, RawBatch
from trainers.datasets import DatasetInfo, inspect_hdf5
from trainers.models import build_model
from trainers.task import StepOutput


class ClassifyTask:
    def __init__(self, model: ModelConfig, data: DataConfig, data_path: Path, trainer: TrainerConfig) -> None:
        self.model_cfg, self.data_cfg, self.path = model, data, Path(data_path)
        self.info: DatasetInfo = inspect_hdf5(self.path, data)
        # NHWC inputs for image models (faster convolutions on GPUs); flat inputs stay as they are
        image = len(self.info.input_shape) == 3
        self.memory_format = torch.channels_last if trainer.channels_last and image else torch.contiguous_format

    def build_model(self) -> nn.Module:
        return build_model(self.model_cfg, self.info.input_shape, self.info.num_classes)

    def train_data(self) -> H5Split:
        return H5Split(self.path, self.data_cfg.train_x, self.data_cfg.train_y)

    def eval_data(self) -> H5Split:
        return H5Split(self.path, self.data_cfg.test_x, self.data_cfg.test_y)

    def batch(self, items: RawBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored values travel (uint8 images stay uint8); float32 inputs are made on the device."""
        x = items.x.to(device, non_blocking=True).to(torch.float32).mul_(items.scale)
        x = x.contiguous(memory_format=self.memory_format) if x.dim() == 4 else x
        return x, items.y.to(device, non_blocking=True)

    def train_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        x, y = batch
        output = model(x)
        correct = int((output.detach().argmax(dim=1) == y).sum())
        return StepOutput(F.cross_entropy(output, y), len(y), {"accuracy": correct})

    def eval_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> StepOutput:
        return self.train_step(model, batch)

    def describe(self) -> dict[str, Any]:
        return {"name": self.model_cfg.name, "input_shape": list(self.info.input_shape), "num_classes": self.info.num_classes}
