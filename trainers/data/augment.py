"""Augmentation of a whole batch on the device it trains on: per-sample random crops and
horizontal flips as a few indexing kernels, no per-image Python. The randomness comes from torch's
RNG on that device, which every checkpoint keeps per rank, so a resumed run draws the same crops."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def random_crop(images: torch.Tensor, size: int, padding: int = 0) -> torch.Tensor:
    """N x C x H x W -> N x C x size x size, each sample cut at its own random offset after zero
    padding by `padding` on every side."""
    if padding:
        images = F.pad(images, (padding, padding, padding, padding))
    n, channels, height, width = images.shape
    if size > min(height, width):
        raise ValueError(f"a crop of {size} does not fit {height} x {width} images")
    device = images.device
    top = torch.randint(0, height - size + 1, (n, 1), device=device) + torch.arange(size, device=device)
    left = torch.randint(0, width - size + 1, (n, 1), device=device) + torch.arange(size, device=device)
    samples = torch.arange(n, device=device)[:, None, None, None]
    planes = torch.arange(channels, device=device)[None, :, None, None]
    return images[samples, planes, top[:, None, :, None], left[:, None, None, :]]


def centre_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """The central size x size of every image (evaluation's counterpart of random_crop)."""
    height, width = images.shape[-2:]
    top, left = (height - size) // 2, (width - size) // 2
    return images[..., top : top + size, left : left + size]


# The bits of uint16/32/64 images as the signed type of their width: flip(), index_select() and
# where() lack unsigned kernels for them in some torch releases (2.11 refused index_select).
SAME_WIDTH_SIGNED = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def random_flip(images: torch.Tensor) -> torch.Tensor:
    """Each image mirrored left-right with probability 1/2."""
    flipped = torch.rand(images.shape[0], device=images.device) < 0.5
    bits = images.view(SAME_WIDTH_SIGNED.get(images.dtype, images.dtype))  # moves values, never reads them
    return torch.where(flipped[:, None, None, None], bits.flip(-1), bits).view(images.dtype)
