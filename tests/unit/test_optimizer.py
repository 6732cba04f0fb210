import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from collectives.base import Deferred, SingleProcess
from collectives.config import CommConfig
from collectives.optimizer import Bucket, Compressor, apply_distributed_optimizer, plan_buckets


@given(st.lists(st.integers(1, 100), max_size=30), st.integers(0, 300))
def test_buckets_keep_order_and_reach_their_size(sizes, bucket_bytes):
    plan = plan_buckets(sizes, bucket_bytes)
    assert [i for bucket in plan for i in bucket] == list(range(len(sizes)))
    if bucket_bytes <= 0:
        assert all(len(b) == 1 for b in plan)
    else:
        assert all(sum(sizes[i] for i in b) >= bucket_bytes for b in plan[:-1])


class CountingTwoRanks(SingleProcess):
    """Pretends a second rank holds identical gradients; counts what would be sent."""

    world_size = 2

    def __init__(self):
        self.allreduces = 0

    def allreduce_async(self, buffer, op="sum"):
        self.allreduces += 1
        if op == "sum":
            buffer.mul_(2)
        return Deferred.of()

    def allgather_async(self, mine):
        return Deferred.of(torch.cat([mine.reshape(-1), mine.reshape(-1)]))


def model_and_batch():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), torch.randn(8, 6), torch.randint(0, 3, (8,))


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("bucket_mb, buckets", [(0, 4), (4, 1)])
def test_wrapped_optimizer_keeps_type_fuses_and_matches_plain_sgd(overlap, bucket_mb, buckets):
    model, x, y = model_and_batch()
    reference = [p.detach().clone() for p in model.parameters()]
    comm = CountingTwoRanks()
    opt = apply_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm, CommConfig(bucket_mb=bucket_mb, overlap=overlap))
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert comm.allreduces == buckets
    for before, grad, after in zip(reference, grads, model.parameters(), strict=True):
        assert torch.allclose(after, before - 0.1 * grad)  # identical ranks: average == own
    opt.remove_hooks()


def test_accumulation_micro_steps_send_nothing():
    model, x, y = model_and_batch()
    comm = CountingTwoRanks()
    opt = apply_distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, comm, CommConfig(bucket_mb=0), backward_passes_per_step=3)
    for micro in range(3):
        nn.functional.cross_entropy(model(x[micro::3]), y[micro::3]).backward()
        if micro < 2:
            assert comm.allreduces == 0
    assert comm.allreduces == 4  # the third backward pass started every bucket
    opt.step()
    assert comm.allreduces == 4


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_half_compression_averages_within_half_precision(kind):
    bucket = Bucket(0, [], torch.randn(1000))
    original = bucket.buffer.clone()
    compressor = Compressor(kind, 0.01, world_size=2)
    compressor.launch(CountingTwoRanks(), bucket)
    compressor.finish(bucket)
    assert torch.allclose(bucket.buffer, original, rtol=1e-2, atol=1e-2) and not torch.equal(bucket.buffer, original)


def test_topk_error_feedback_conserves_the_gradient():
    """Over steps, what was sent plus what is still held back equals what was produced."""
    torch.manual_seed(1)
    compressor = Compressor("topk", 0.1, world_size=1)
    bucket = Bucket(0, [], torch.zeros(50))
    produced, sent = torch.zeros(50), torch.zeros(50)
    for _ in range(5):
        grad = torch.randn(50)
        produced += grad
        bucket.buffer.copy_(grad)
        indices, values = compressor.select_topk(bucket)
        assert len(indices) == 5
        sent.index_add_(0, indices, values)
    assert torch.allclose(sent + bucket.residual, produced, atol=1e-5)


@pytest.mark.parametrize(
    "kind, ratio, message",
    [
        ("gzip", 0.1, "comm.compression='gzip' is not one of none, fp16, bf16, topk"),
        ("topk", 0.0, "comm.topk_ratio=0.0 must be in (0, 1]"),
        ("topk", 1.5, "comm.topk_ratio=1.5 must be in (0, 1]"),
    ],
)
def test_bad_compression_settings_are_refused(kind, ratio, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Compressor(kind, ratio, 2)
