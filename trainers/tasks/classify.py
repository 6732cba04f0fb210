"""Classification on an HDF5 data set, one file or shards (trainers.data.datasets): a built-in model
(mlp, cnn, resnet50), cross-entropy loss, accuracy as the metric, and the data config's crop and
flip applied on the training device."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from trainers.config import DataConfig, ModelConfig, TrainerConfig
from trainers.data.augment import centre_crop, random_crop, random_flip
from trainers.data.datasets import DatasetInfo, augmented_shape, inspect_hdf5
from trainers.data.reading import H5Split, RawBatch
from trainers.models import build_model
from trainers.task import StepOutput


class ClassifyTask:
    def __init__(self, model: ModelConfig, data: DataConfig, data_path: Path | Sequence[Path], trainer: TrainerConfig) -> None:
        self.model_cfg, self.data_cfg = model, data
        self.files = [Path(data_path)] if isinstance(data_path, str | Path) else [Path(p) for p in data_path]
        self.info: DatasetInfo = inspect_hdf5(self.files, data)
        self.input_shape = augmented_shape(data, self.info)
        # NHWC inputs for image models (faster convolutions on GPUs); flat inputs stay as they are
        image = len(self.info.input_shape) == 3
        self.memory_format = torch.channels_last if trainer.channels_last and image else torch.contiguous_format

    def build_model(self) -> nn.Module:
        return build_model(self.model_cfg, self.input_shape, self.info.num_classes)

    def train_data(self) -> H5Split:
        return H5Split(self.files, self.data_cfg.train_x, self.data_cfg.train_y)

    def eval_data(self) -> H5Split:
        return H5Split(self.files, *self.info.val_split)

    def test_data(self) -> H5Split | None:
        return H5Split(self.files, *self.info.test_split) if self.info.test_split else None

    def batch(self, items: RawBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Stored values travel (uint8 images stay uint8); the steps augment and decode them there."""
        return items.x.to(device, non_blocking=True), items.y.to(device, non_blocking=True), items.scale

    def inputs(self, stored: torch.Tensor, scale: float, train: bool) -> torch.Tensor:
        """Float32 inputs from stored values, cropped (at random in training) and flipped first,
        while they are still compact."""
        cfg = self.data_cfg
        if cfg.crop is not None:
            stored = random_crop(stored, cfg.crop, cfg.crop_padding) if train else centre_crop(F.pad(stored, (cfg.crop_padding,) * 4), cfg.crop)
        if cfg.flip and train:
            stored = random_flip(stored)
        x = stored.to(torch.float32).mul_(scale)
        return x.contiguous(memory_format=self.memory_format) if x.dim() == 4 else x

    def train_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, float]) -> StepOutput:
        return self._step(model, self.inputs(batch[0], batch[2], train=True), batch[1])

    def eval_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, float]) -> StepOutput:
        return self._step(model, self.inputs(batch[0], batch[2], train=False), batch[1])

    def _step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        output = model(x)
        correct = (output.detach().argmax(dim=1) == y).sum()  # stays on the device: read with the step's sums
        return StepOutput(F.cross_entropy(output, y), len(y), {"accuracy": correct})

    def describe(self) -> dict[str, Any]:
        return {"name": self.model_cfg.name, "input_shape": list(self.input_shape), "num_classes": self.info.num_classes}
