"""The built-in loop's cost on the host (issue 43): one read of a device value per step, a step
skipped on the device when its gradients are not finite, and nothing a world of one does not
need. Reads are counted by benchmarks.host_overhead's torch function mode, the CPU proxy that CI
runs; its microseconds stay a benchmark figure (docs/benchmarks.md), never asserted."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from benchmarks.host_overhead import HostReads, builtin_loop, counting, main, per_step, proxy_config
from collectives.base import SingleProcess
from collectives.config import CommConfig
from collectives.gradsync import LocalGradients, build_gradient_sync
from collectives.replicated import nonfinite
from trainers.boundary import packed
from trainers.optim import build_optimizer, skips_on_device, step_unless


def test_the_counter_sees_every_kind_of_read_of_a_tensor_on_the_host():
    t = torch.tensor([2.5])
    with counting() as reads:
        t.item(), t.tolist(), float(t), bool(t), int(t), t.cpu(), t.numpy()
        if t > 0:  # a comparison's truth value is a read too
            pass
        torch.ones(3).add_(1)  # arithmetic reads nothing
    assert reads.counts == {"item": 1, "tolist": 1, "__float__": 1, "__bool__": 2, "__int__": 1, "cpu": 1, "numpy": 1}


def test_the_built_in_loop_reads_the_device_once_per_step(tmp_path):
    with counting() as reads:
        marks = builtin_loop(40, tmp_path, reads)
    assert len(marks) == 40
    assert per_step(marks, warmup=5)[1] == 1.0  # the step's sums, and nothing else


def test_an_optimizer_that_cannot_skip_on_the_device_costs_one_read_more(tmp_path, monkeypatch):
    """RMSprop has no fused kernel: whether a step is finite is read on the host before it."""
    import benchmarks.host_overhead as bench

    plain = bench.proxy_config

    def with_rmsprop(steps: int):  # type: ignore[no-untyped-def]
        cfg = plain(steps)
        return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, optimizer={"_target_": "torch.optim.RMSprop"}))

    monkeypatch.setattr(bench, "proxy_config", with_rmsprop)
    with counting() as reads:
        marks = builtin_loop(30, tmp_path, reads)
    assert per_step(marks, warmup=5)[1] == 2.0


def test_the_benchmark_prints_one_json_line_with_the_figures_ci_watches(capsys):
    assert main(["--steps", "25", "--warmup", "5", "--rounds", "1"]) == 0
    figures = json.loads(capsys.readouterr().out.strip())
    assert figures["host_reads_per_step"] == 1.0 and figures["raw_host_reads_per_step"] == 0.0
    assert isinstance(figures["overhead_us_per_step"], float) and figures["loop_us_per_step"] > 0 and figures["raw_us_per_step"] > 0


def poisoned(model: nn.Module) -> None:
    """Gradients that hold a NaN, as an overflowing step leaves them."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    next(model.parameters()).grad[0, 0] = float("nan")  # type: ignore[index]


def finite(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


OPTIMIZERS = {
    "sgd with momentum": lambda params: build_optimizer(proxy_config(1).optim, params),
    "sgd": lambda params: build_optimizer(dataclasses.replace(proxy_config(1).optim, momentum=0.0), params),
    "adamw": lambda params: build_optimizer(dataclasses.replace(proxy_config(1).optim, name="adamw"), params),
    "rmsprop (no fused kernel)": lambda params: torch.optim.RMSprop(params, lr=0.01),
}


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad_step", [0, 2])
def test_a_step_on_non_finite_gradients_changes_nothing_whichever_step_it_is(kind, bad_step):
    """The run with a poisoned step skipped equals the run without that step, bit for bit,
    parameters and optimizer state (the first step too: fused SGD's own skip leaves its new
    momentum buffer uninitialised, so that one is decided on the host)."""

    def train(skip: bool) -> tuple[list[torch.Tensor], dict]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        optimizer = OPTIMIZERS[kind](model.parameters())
        for step in range(4):
            if step == bad_step:
                if not skip:
                    continue
                poisoned(model)
                flag = nonfinite(model)
                assert flag.item() == 1.0
            else:
                finite(model, step)
                flag = nonfinite(model)
                assert flag.item() == 0.0
            step_unless(optimizer, flag)
        return [p.detach().clone() for p in model.parameters()], optimizer.state_dict()

    skipped, skipped_state = train(skip=True)
    never, never_state = train(skip=False)
    assert all(torch.equal(a, b) for a, b in zip(skipped, never, strict=True))
    for index, state in never_state["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(skipped_state["state"][index][key]), torch.as_tensor(value)), (index, key)


def test_the_built_in_optimizers_skip_on_the_device_once_their_state_exists():
    model = nn.Linear(4, 2)
    sgd = OPTIMIZERS["sgd with momentum"](model.parameters())
    assert not skips_on_device(sgd)  # no momentum buffer yet: the host decides the first step
    finite(model, 0)
    step_unless(sgd, nonfinite(model))
    assert skips_on_device(sgd)
    assert skips_on_device(OPTIMIZERS["adamw"](model.parameters()))
    assert not skips_on_device(OPTIMIZERS["rmsprop (no fused kernel)"](model.parameters()))


def test_the_step_sums_travel_in_order_as_float64_whatever_their_types():
    values = [3, 0.25, torch.tensor(1.5, dtype=torch.float32), torch.tensor(7), 2.0, torch.tensor([4.0], dtype=torch.float64), torch.tensor(True)]
    buffer = packed([1.0, 0.0], values)
    assert buffer.dtype == torch.float64 and buffer.tolist() == [1.0, 0.0, 3.0, 0.25, 1.5, 7.0, 2.0, 4.0, 1.0]
    big = torch.tensor(2**40 + 1)  # an int64 beside a float32 is not squeezed through float32
    assert packed([], [torch.tensor(0.5), big]).tolist() == [0.5, float(2**40 + 1)]


@pytest.mark.parametrize("backend", ["mpi", "gloo", "nccl", "horovod"])
def test_a_world_of_one_trains_the_model_itself_without_a_gradient_sync(backend):
    """No DDP reducer, no hooks, no bucket copies: nothing is averaged with nobody."""
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_gradient_sync(model, optimizer, SingleProcess(), CommConfig(backend=backend), accumulation=2)
    assert isinstance(sync, LocalGradients) and sync.module is model and sync.optimizer is optimizer
    assert not model._forward_hooks and not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_the_reads_are_counted_on_the_thread_that_trains():
    """A torch function mode is per thread: reads on a loader thread are not the training
    thread's (they never make it wait for the device)."""
    import threading

    reads = HostReads()
    with reads:
        worker = threading.Thread(target=lambda: torch.tensor(1.0).item())
        worker.start()
        worker.join()
        torch.tensor(1.0).item()
    assert reads.total == 1
