"""The device suite's `compile` check (issue 43, part 4): lm and resnet50 with trainer.compile=true
against their reference loops compiled the same way (benchmarks/device/throughput.py's pairs with
a backend), in interleaved rounds; then, on the GPU, the plain lm loop under CUDA graphs."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.device.report import Report
from benchmarks.device.rounds import interleave
from benchmarks.device.throughput import IMAGES, LM_BATCH, LM_SHAPE, PlainLM, image_data, image_pair, lm_pair, lm_tokens

COMPILE_BACKEND = {"gpu": "inductor", "cpu": "eager"}  # cpu mode: dynamo's capture alone, the quickest


def compile_check(mode: str, scratch: Path, report: Report, rounds: int = 1) -> None:
    """lm and resnet50 with trainer.compile=true against their reference loops compiled the same
    way, `rounds` interleaved rounds (lm first in each: the cheaper compile); then the plain lm loop
    under CUDA graphs (gpu mode), if the check's budget has room."""
    backend = COMPILE_BACKEND[mode]
    setup = IMAGES[mode]
    tokens, images = lm_tokens(mode, scratch), image_data(setup, scratch)
    report.figure("set-up", f"torch.compile backend {backend!r}, default mode, both sides; the lm and resnet50 checks' shapes and steps; {rounds} rounds")
    pairs = [lm_pair(mode, tokens, scratch, report, backend, {}), image_pair(mode, setup, images, scratch, report, backend)]
    for pair in pairs:  # the references' cold compiles before the rounds (kept for all of them); on the GPU they may warm inductor's cache for the toolkit
        began = time.monotonic()
        pair.run_reference(0)
        print(f"{pair.name}: reference compiled and warmed up in {time.monotonic() - began:.1f} s", flush=True)
    interleave(pairs, rounds, report)
    if mode != "gpu":
        report.note("CUDA graphs (torch.compile mode='reduce-overhead'): gpu mode only")
    elif report.seconds_left() < 60:
        report.note(f"CUDA graphs not measured: {report.seconds_left():.0f} s of the check's budget left")
    else:
        seconds, _ = PlainLM(mode, tokens, backend, "reduce-overhead").run()
        batch, context = LM_BATCH[mode], LM_SHAPE[mode]["context"]
        graphed = batch * context / seconds
        report.figure("plain lm loop, torch.compile(mode='reduce-overhead') (CUDA graphs), tokens/s", graphed)
        compiled = report.data["pairs"]["lm, compiled"]["reference_median"]
        report.figure("CUDA graphs / default compile, plain lm loop (> 1: compile alone leaves launch overhead)", graphed / compiled)
