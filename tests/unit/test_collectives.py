import torch
from torch import nn

from collectives.base import FakeCollectives, _flat, _unflatten_into, broadcast_module


def test_flatten_roundtrip_preserves_shapes_and_values():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    copies = [torch.zeros_like(t) for t in tensors]
    _unflatten_into(_flat(tensors), copies)
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies, strict=True))


def test_single_rank_broadcast_is_identity():
    model = nn.Linear(3, 3)
    before = [p.clone() for p in model.parameters()]
    broadcast_module(FakeCollectives(), model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
