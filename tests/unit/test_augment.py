"""Crops and flips of a whole batch: every output is a window (or mirror) of its own input, drawn
from torch's RNG, so the same RNG state gives the same batch."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from trainers.data.augment import centre_crop, random_crop, random_flip


def images(n: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, 9, 11), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def test_each_crop_is_a_window_of_its_own_padded_image_at_varied_offsets():
    batch = images()
    torch.manual_seed(1)
    crops = random_crop(batch, 7, padding=2)
    padded = F.pad(batch, (2, 2, 2, 2))
    assert crops.shape == (64, 3, 7, 7) and crops.dtype == torch.uint8
    offsets = set()
    for i in range(64):
        found = [(t, s) for t in range(13 - 7 + 1) for s in range(15 - 7 + 1) if torch.equal(padded[i, :, t : t + 7, s : s + 7], crops[i])]
        assert found, f"crop {i} is not a window of its image"
        offsets.add(found[0])
    assert len(offsets) > 10  # offsets differ per sample


def test_the_same_rng_state_gives_the_same_augmented_batch():
    batch = images()
    torch.manual_seed(5)
    first = random_flip(random_crop(batch, 8, padding=1))
    torch.manual_seed(5)
    assert torch.equal(first, random_flip(random_crop(batch, 8, padding=1)))
    assert not torch.equal(first, random_flip(random_crop(batch, 8, padding=1)))


def test_flips_mirror_about_half_the_images_and_leave_the_rest():
    batch = images(400)
    torch.manual_seed(2)
    out = random_flip(batch)
    mirrored = [torch.equal(out[i], batch[i].flip(-1)) for i in range(400)]
    kept = [torch.equal(out[i], batch[i]) for i in range(400)]
    assert all(m or k for m, k in zip(mirrored, kept, strict=True))
    assert 150 < sum(mirrored) < 250


def test_centre_crop_and_crops_that_do_not_fit():
    batch = images()
    assert torch.equal(centre_crop(batch, 5), batch[..., 2:7, 3:8])
    with pytest.raises(ValueError, match="a crop of 10 does not fit 9 x 11"):
        random_crop(batch, 10)


def test_sixteen_bit_images_flip_too():
    batch = torch.arange(2 * 3 * 4, dtype=torch.int32).reshape(2, 1, 3, 4).to(torch.uint16)
    torch.manual_seed(0)
    out = random_flip(batch)
    assert all(torch.equal(out[i], batch[i]) or torch.equal(out[i].int(), batch[i].int().flip(-1)) for i in range(2))
