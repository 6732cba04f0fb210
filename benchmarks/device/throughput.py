"""The device suite's throughput checks (issue 43): the toolkit against a reference loop of the same
model, batch and precision on the same device, in interleaved rounds (benchmarks/device/rounds.py).
This module: resnet50 and lm, and their pairs; nanogpt.py and compiled.py hold the other two.

resnet50  launch.py's ResNet-50 (uint8 HDF5 through loader processes; crop, flip and uint8 -> float
          on the GPU) against a raw loop doing the same device work on uint8 batches held in
          pinned host memory; beside it, issue 43's first bar: one float batch already on the GPU.
lm        task=lm against a plain loop of the same GPT, token file, AdamW and bf16.
nanogpt   a nanoGPT-like script with the run handle under launch.py against the same script
          without it under torchrun (benchmarks/device/nanogpt_like.py).
compile   lm and resnet50 again, trainer.compile=true against the same reference loops with
          torch.compile(model) (default mode, the same backend: inductor on the GPU; eager in
          cpu mode, to stay quick); then, on the GPU, the plain lm loop under CUDA graphs
          (mode="reduce-overhead"), to tell whether compile alone leaves launch overhead.

Step counts in gpu mode are sized for issue 43's command (5 rounds of all of these, with resume and
handle, in about 9 minutes on one H100 or H200): see benchmarks/device/__main__.py.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.nn import functional as F

from benchmarks.device.report import Report, device_overrides, launch, step_records
from benchmarks.device.rounds import Measured, Pair, interleave

RATIO_TARGET = {"resnet50": 0.98, "lm": 0.98, "nanogpt": 0.99}  # issue 43's "Done means"
PHASE_KEYS = ("step_ms", "data_ms", "compute_ms", "comm_ms", "optimizer_ms")
HELD_BATCHES = 4  # the raw loop's uint8 batches in pinned memory, used in turn


@dataclass(frozen=True)
class Images:
    model: str
    shape: tuple[int, int, int]
    n: int  # training images; the toolkit's rate is its 2nd epoch's (n / batch steps)
    batch: int
    workers: int
    steps: int  # the raw loop's timed steps
    warmup: int  # the raw loop's steps before them
    precision: str  # both sides: bf16 autocast (gpu), fp32 (cpu mode: quick plumbing on CPUs without bf16 kernels)


IMAGES = {"gpu": Images("resnet50", (3, 224, 224), 7680, 256, 8, 20, 5, "bf16"), "cpu": Images("cnn", (3, 32, 32), 160, 32, 2, 2, 1, "fp32")}
LM_SHAPE = {"gpu": {"context": 256, "layers": 6, "heads": 6, "width": 384}, "cpu": {"context": 32, "layers": 1, "heads": 2, "width": 32}}
LM_BATCH = {"gpu": 64, "cpu": 8}
LM_STEPS = {"gpu": (160, 40), "cpu": (12, 4)}  # (steps, warm-up steps left out of the rate)


def device_of(mode: str) -> torch.device:
    return torch.device("cuda" if mode == "gpu" else "cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device: torch.device) -> None:
    """The reference's cached blocks back to the GPU before the toolkit's process runs."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fused_if_possible(kind: Any, params: list[torch.nn.Parameter], **options: Any) -> torch.optim.Optimizer:
    """The reference's optimizer as a careful user writes it (nanoGPT does): fused where torch has it."""
    try:
        return kind(params, fused=True, **options)
    except (RuntimeError, ValueError, TypeError):
        return kind(params, **options)


# --- resnet50 -------------------------------------------------------------------------------------


def resnet50(mode: str, scratch: Path, report: Report, rounds: int = 1) -> None:
    """The trainer's images/s against the raw loop's, `rounds` interleaved rounds."""
    setup = IMAGES[mode]
    data = image_data(setup, scratch)
    report.figure("set-up", f"{setup.model}, batch {setup.batch}, {setup.precision}, channels_last, {setup.n} uint8 {setup.shape} images, {rounds} rounds")
    interleave([image_pair(mode, setup, data, scratch, report, None)], rounds, report)


def image_data(setup: Images, scratch: Path) -> Path:
    from benchmarks import gpu_throughput

    scratch.mkdir(parents=True, exist_ok=True)
    data = scratch / "images.h5"
    if (shared := scratch.parent / "resnet50" / data.name).exists():  # the resnet50 check's, beside (1.2 GB on the GPU: 8 s to write)
        return shared
    if not data.exists():
        gpu_throughput.write_images(data, setup.n, setup.shape, classes=1000)
    return data


def image_pair(mode: str, setup: Images, data: Path, scratch: Path, report: Report, backend: str | None) -> Pair:
    name = "resnet50" + (", compiled" if backend else "")
    raw = RawImages(setup, device_of(mode), backend)
    compiled = ["trainer.compile=true", f"trainer.compile_backend={backend}"] if backend else []
    where = "GPU" if mode == "gpu" else "CPU"
    toolkit_does = (
        f"launch.py {device_overrides(mode)[0]}, 1 rank, model={setup.model}{compiled_by_toolkit(backend)}: "
        f"{setup.n} uint8 images read from HDF5 by data.workers={setup.workers} loader processes, copied to the {where}, cropped "
        f"(data.crop={setup.shape[-1]}) + flipped + made float there; {setup.precision}, channels_last, SGD; the img/s of its 2nd epoch (metrics.jsonl)"
    )
    reference_does = (
        f"raw loop in the check's process: the same model{compiled_by_hand(backend)}, "
        f"batch, {setup.precision}, channels_last, SGD (fused where torch has it); {HELD_BATCHES} uint8 batches held in pinned host memory, used in turn, "
        f"copied non_blocking on the default stream (as a DataLoader(pin_memory=True) loop), cropped + flipped (trainers.data.augment's kernels) "
        f"and made float on the {where} every step: the toolkit's device work, without reading files; {setup.steps} timed steps after {setup.warmup}. "
        f"Beside it: the same loop on one float batch already on the {where} (issue 43's first bar)"
    )

    def toolkit(index: int) -> Measured:
        return toolkit_images(mode, setup, data, scratch / f"{name.replace(', ', '-')}-{index + 1}", compiled, report, name)

    return Pair(name, "img/s", RATIO_TARGET["resnet50"], toolkit_does, reference_does, toolkit, raw.measure)


def compiled_by_toolkit(backend: str | None) -> str:
    return f", trainer.compile=true (torch.compile, {backend})" if backend else ""


def compiled_by_hand(backend: str | None) -> str:
    return f", torch.compile(model, backend={backend!r}) once, reused every round" if backend else ""


def phases(name: str) -> str:
    return f"{name}: toolkit's median ms per step, last round: " + ", ".join(k.removesuffix("_ms") for k in PHASE_KEYS)


def toolkit_images(mode: str, setup: Images, data: Path, workdir: Path, extra: list[str], report: Report, name: str) -> Measured:
    overrides = [
        f"model={setup.model}",
        f"data.path={data}",
        f"data.batch_size={setup.batch}",
        "data.eval_batch_size=256",
        f"data.workers={setup.workers}",
        f"data.crop={setup.shape[-1]}",
        "data.flip=true",
        f"trainer.precision={setup.precision}",
        "trainer.channels_last=true",
        "trainer.epochs=2",
        "checkpoint.enabled=false",
        "resources.tasks_per_node=1",
        "optim.schedule=constant",
        f"trainer.threads_per_rank={torch.get_num_threads()}",  # as many threads as the reference in this process
        *device_overrides(mode),
        *extra,
    ]
    run_dir = launch(overrides, workdir)
    epoch = epoch_records(run_dir)[-1]
    steps = [r for r in step_records(run_dir) if r["epoch"] == epoch["epoch"]]
    report.figure(phases(name), [statistics.median(s[k] for s in steps) for k in PHASE_KEYS])
    # The epoch's rate counts its start (the first batches read after the epoch's indices are
    # drawn): 1 step in 30 here, 1 in thousands in a real epoch. Beside it, the steady state,
    # measured as the raw loop is (steps after the first few).
    steady = setup.batch / step_seconds(steps, warmup=steps[0]["step"] + setup.warmup) if len(steps) >= setup.warmup + 3 else None
    variants = {f"steady state (step times after the epoch's first {setup.warmup})": steady} if steady else {}
    return Measured(float(epoch["samples_per_s"]), epoch["data_wait_ms"] / epoch["step_ms"], variants=variants)


def epoch_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's epoch records (the ones with the epoch's rate and its data wait)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "samples_per_s" in r and "data_wait_ms" in r]


class RawImages:
    """The raw loop of an image pair. Eager: built anew each round, as the toolkit's run is; compiled:
    built and compiled once (the first round), reused."""

    def __init__(self, setup: Images, device: torch.device, backend: str | None) -> None:
        self.setup, self.device, self.backend = setup, device, backend
        self.kept: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None

    def build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from trainers.config import ModelConfig
        from trainers.models import build_model

        setup = self.setup
        model = build_model(ModelConfig(name=setup.model, hidden_sizes=[] if setup.model == "resnet50" else [128]), setup.shape, 1000)
        model = model.to(self.device, memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch stubs lack memory_format
        optimizer = fused_if_possible(torch.optim.SGD, list(model.parameters()), lr=0.05, momentum=0.9)
        module = cast(torch.nn.Module, torch.compile(model, backend=self.backend)) if self.backend else model
        return module, optimizer

    def measure(self, index: int) -> Measured:
        module, optimizer = self.kept or self.build()
        rates = self.rates(module, optimizer, index)
        self.kept = (module, optimizer) if self.backend else None
        release(self.device)
        return Measured(rates["same"], others={"raw loop, batch already on the device": rates["bar"]})

    def rates(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, index: int) -> dict[str, float]:
        from trainers.data.augment import random_crop, random_flip

        setup, device = self.setup, self.device
        pinned = device.type == "cuda"
        held = [torch.randint(0, 256, (setup.batch, *setup.shape), dtype=torch.uint8) for _ in range(HELD_BATCHES)]
        labels = [torch.randint(0, 1000, (setup.batch,)) for _ in range(HELD_BATCHES)]
        if pinned:
            held, labels = [x.pin_memory() for x in held], [y.pin_memory() for y in labels]
        on_device = (held[0].to(device).float().div_(255).contiguous(memory_format=torch.channels_last), labels[0].to(device))

        def same_work(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            x = held[i % HELD_BATCHES].to(device, non_blocking=pinned)
            y = labels[i % HELD_BATCHES].to(device, non_blocking=pinned)
            x = random_flip(random_crop(x, setup.shape[-1])).to(torch.float32).mul_(1 / 255)
            return x.contiguous(memory_format=torch.channels_last), y

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.precision == "bf16"):
                loss = F.cross_entropy(module(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def rate(inputs: Any) -> float:
            for i in range(setup.warmup):
                step(*inputs(i))
            synchronize(device)
            began = time.perf_counter()
            for i in range(setup.steps):
                step(*inputs(i))
            synchronize(device)
            return setup.batch * setup.steps / (time.perf_counter() - began)

        variants = {"same": same_work, "bar": lambda i: on_device}
        return {name: rate(variants[name]) for name in (("same", "bar") if index % 2 == 0 else ("bar", "same"))}


# --- lm -------------------------------------------------------------------------------------------


def lm(mode: str, scratch: Path, report: Report, rounds: int = 1) -> None:
    """task=lm's tokens/s against the plain loop's, `rounds` interleaved rounds, and both loss curves."""
    tokens = lm_tokens(mode, scratch)
    shape, batch, (steps, warmup) = LM_SHAPE[mode], LM_BATCH[mode], LM_STEPS[mode]
    precision = "bf16" if mode == "gpu" else "fp32"
    report.figure("set-up", f"GPT {shape}, batch {batch}, {steps} steps ({warmup} warm-up), AdamW lr 1e-3, {precision}, stdlib sources, {rounds} rounds")
    curves: dict[str, Any] = {}
    interleave([lm_pair(mode, tokens, scratch, report, None, curves)], rounds, report)
    if "toolkit" in curves and "plain" in curves:
        marks = sorted({1, *range(25 if mode == "gpu" else 5, steps + 1, 25 if mode == "gpu" else 5)})
        losses, plain = {int(r["step"]): float(r["loss"]) for r in curves["toolkit"]}, curves["plain"]
        rows = [f"| {s} | {losses[s]:.4f} | {plain[s - 1]:.4f} |" for s in marks if s in losses and s <= len(plain)]
        title = f"{precision} loss curve, round 1 (the same model shape, data, optimizer and precision; weights and batch order drawn by each)"
        report.table(f"{title}:\n\n| step | toolkit | plain loop |\n| --- | --- | --- |\n" + "\n".join(rows))


def lm_tokens(mode: str, scratch: Path) -> Path:
    from trainers.data.tokens import write_token_file

    scratch.mkdir(parents=True, exist_ok=True)
    tokens = scratch / "tokens.h5"
    if (shared := scratch.parent / "lm" / tokens.name).exists():  # the lm check's, beside
        return shared
    if not tokens.exists():
        write_token_file(stdlib_text(5 << 20 if mode == "gpu" else 1 << 20), tokens, 0.01)  # gpu: about 300 steps of 64 x 256 in one epoch
    return tokens


def lm_pair(mode: str, tokens: Path, scratch: Path, report: Report, backend: str | None, curves: dict[str, Any]) -> Pair:
    name = "lm" + (", compiled" if backend else "")
    shape, batch, (steps, warmup) = LM_SHAPE[mode], LM_BATCH[mode], LM_STEPS[mode]
    context = shape["context"]
    plain = PlainLM(mode, tokens, backend)
    compiled = ["trainer.compile=true", f"trainer.compile_backend={backend}"] if backend else []
    precision = "bf16" if mode == "gpu" else "fp32"
    toolkit_does = (
        f"launch.py task=lm {device_overrides(mode)[0]}, 1 rank{compiled_by_toolkit(backend)}: "
        f"windows of the token file read ahead by the toolkit's loader, AdamW, {precision}; tokens/s from steps.jsonl's step times after step {warmup}"
    )
    reference_does = (
        f"plain loop in the check's process: the same GPT{compiled_by_hand(backend)}, "
        f"token file and batch; windows read on the training thread (ShardSampler + TokenWindows), pinned and copied non_blocking; "
        f"AdamW (fused where torch has it), {precision}; {steps - warmup} timed steps after {warmup}, device synchronised at both ends"
    )

    def toolkit(index: int) -> Measured:
        records, wait = toolkit_lm(mode, tokens, scratch / f"{name.replace(', ', '-')}-{index + 1}", compiled, report, name)
        if index == 0:
            curves["toolkit"] = records
        return Measured(batch * context / step_seconds(records, warmup), wait)

    def reference(index: int) -> Measured:
        seconds, losses = plain.run()
        if index == 0:
            curves["plain"] = losses
        return Measured(batch * context / seconds)

    return Pair(name, "tokens/s", RATIO_TARGET["lm"], toolkit_does, reference_does, toolkit, reference)


def toolkit_lm(mode: str, tokens: Path, workdir: Path, extra: list[str], report: Report, name: str) -> tuple[list[dict[str, Any]], float]:
    shape, batch, (steps, warmup) = LM_SHAPE[mode], LM_BATCH[mode], LM_STEPS[mode]
    overrides = [
        "task=lm",
        f"task.tokens={tokens}",
        *(f"task.{k}={v}" for k, v in shape.items()),
        f"data.batch_size={batch}",
        f"trainer.max_steps={steps}",
        "trainer.epochs=1",
        f"trainer.precision={'bf16' if mode == 'gpu' else 'fp32'}",
        "trainer.log_every=1000000",
        "optim.lr=0.001",
        "optim.weight_decay=0.01",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "checkpoint.enabled=false",
        "resources.tasks_per_node=1",
        f"trainer.threads_per_rank={torch.get_num_threads()}",
        *device_overrides(mode),
        *extra,
    ]
    run_dir = launch(overrides, workdir)
    records = step_records(run_dir)
    timed = [r for r in records if r["step"] > warmup]
    report.figure(phases(name), [statistics.median(r[k] for r in timed) for k in PHASE_KEYS])
    epoch = epoch_records(run_dir)[-1]
    return records, epoch["data_wait_ms"] / epoch["step_ms"]


def stdlib_text(size: int) -> str:
    """About `size` bytes of the Python standard library's sources, in name order: a corpus every
    machine has, larger than the embedded one (470 kB) so that one epoch holds the timed steps."""
    parts, total = [], 0
    for path in sorted(Path(os.__file__).parent.glob("*/*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= size:
            break
    return "\n\n".join(parts)


def step_seconds(records: list[dict[str, Any]], warmup: int) -> float:
    """Mean seconds per step after `warmup`, from the times the steps were logged, counting only
    gaps inside an epoch (an evaluation between epochs is not a step)."""
    gaps = [b["time"] - a["time"] for a, b in zip(records, records[1:], strict=False) if a["step"] >= warmup and a["epoch"] == b["epoch"]]
    return statistics.fmean(gaps)


class PlainLM:
    """The loop a user writes for the lm pair. Eager: built anew each run; compiled: built and
    compiled once, reused (the weights train on; the speed does not depend on them)."""

    def __init__(self, mode: str, tokens: Path, backend: str | None, compile_mode: str | None = None) -> None:
        self.mode, self.tokens, self.backend, self.compile_mode = mode, tokens, backend, compile_mode
        self.kept: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None

    def build(self, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        from trainers.data.tokens import VOCAB_SIZE
        from trainers.gpt import GPT, GPTShape

        torch.manual_seed(0)
        model = GPT(GPTShape(vocab_size=VOCAB_SIZE, **LM_SHAPE[self.mode])).to(device)
        optimizer = fused_if_possible(torch.optim.AdamW, list(model.parameters()), lr=0.001, weight_decay=0.01)
        if self.backend:
            return cast(torch.nn.Module, torch.compile(model, backend=self.backend, mode=self.compile_mode)), optimizer
        return model, optimizer

    def run(self) -> tuple[float, list[float]]:
        """Seconds per step after the warm-up (the device synchronised at both ends), and the losses."""
        from trainers.data.sampler import ShardSampler
        from trainers.data.tokens import TokenWindows
        from trainers.gpt import next_token_loss

        mode, device = self.mode, device_of(self.mode)
        shape, batch, (steps, warmup) = LM_SHAPE[mode], LM_BATCH[mode], LM_STEPS[mode]
        module, optimizer = self.kept or self.build(device)
        graphs = self.compile_mode == "reduce-overhead"
        windows = TokenWindows(self.tokens, "train", shape["context"])
        sampler = ShardSampler(len(windows), batch, 0, 1, 0)
        losses: list[torch.Tensor] = []
        started = 0.0
        for step, indices in enumerate(sampler.batches(0), start=1):
            if step == warmup + 1:
                synchronize(device)
                started = time.perf_counter()
            items = windows.__getitems__(indices.tolist())
            x, y = torch.stack([cast(torch.Tensor, i[0]) for i in items]), torch.stack([cast(torch.Tensor, i[1]) for i in items])
            if device.type == "cuda":
                x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "gpu"):
                loss = next_token_loss(module(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone() if graphs else loss.detach())
            if step == steps:
                break
        synchronize(device)
        seconds = (time.perf_counter() - started) / (steps - warmup)
        self.kept = (module, optimizer) if self.backend else None
        del module, optimizer
        release(device)
        return seconds, [float(v) for v in losses]
