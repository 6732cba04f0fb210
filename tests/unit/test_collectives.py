import torch
from torch import nn

from collectives.base import FakeCollectives, _flat, _unflatten_into, allreduce_gradients, broadcast_module


class Doubling(FakeCollectives):
    """Pretends a second rank holds the same values: a sum doubles, an average is unchanged."""

    world_size = 2

    def __init__(self):
        self.calls = 0

    def allreduce_(self, buffer, op="sum"):
        self.calls += 1
        if op == "sum":
            buffer.mul_(2)


def test_flatten_roundtrip_preserves_shapes_and_values():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    copies = [torch.zeros_like(t) for t in tensors]
    _unflatten_into(_flat(tensors), copies)
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies, strict=True))


def test_gradients_are_fused_into_one_call_per_dtype():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model(torch.randn(3, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    comm = Doubling()
    allreduce_gradients(comm, model.parameters())
    assert comm.calls == 1
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))


def test_single_rank_broadcast_is_identity():
    model = nn.Linear(3, 3)
    before = [p.clone() for p in model.parameters()]
    broadcast_module(FakeCollectives(), model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
