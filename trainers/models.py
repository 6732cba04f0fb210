"""Models for the trainer, built from ModelConfig and the data set's shape."""

from __future__ import annotations

import math

from torch import nn

from trainers.config import MODELS, ModelConfig


def _mlp_head(in_features: int, hidden_sizes: list[int], num_classes: int, dropout: float) -> list[nn.Module]:
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return layers


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if cfg.name == "mlp":
        return nn.Sequential(nn.Flatten(), *_mlp_head(math.prod(input_shape), cfg.hidden_sizes, num_classes, cfg.dropout))
    if cfg.name == "cnn":
        if len(input_shape) != 3:
            raise ValueError(f"model=cnn needs C x H x W inputs, the data set has shape {input_shape}")
        channels, height, width = input_shape
        layers: list[nn.Module] = []
        for out_channels in cfg.channels or [32]:
            layers += [nn.Conv2d(channels, out_channels, 3, padding=1), nn.BatchNorm2d(out_channels), nn.ReLU()]
            channels = out_channels
        layers += [nn.MaxPool2d(2), nn.Flatten()]
        features = channels * (height // 2) * (width // 2)
        return nn.Sequential(*layers, *_mlp_head(features, cfg.hidden_sizes, num_classes, cfg.dropout))
    if cfg.name == "resnet50":
        if len(input_shape) != 3:
            raise ValueError(f"model=resnet50 needs C x H x W images, the data set has shape {input_shape}")
        try:
            import torchvision
        except ImportError:
            raise ValueError("model=resnet50 needs torchvision (install the build matching your torch)") from None
        model = torchvision.models.resnet50(num_classes=num_classes)
        if input_shape[0] != 3:
            model.conv1 = nn.Conv2d(input_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
        return model
    raise ValueError(f"unknown model {cfg.name!r}; choose one of {', '.join(MODELS)}")
