"""The device suite's `nanogpt` check (issue 43): a nanoGPT-like script (benchmarks/device/nanogpt_like.py)
with the run handle under launch.py against the same script without it under torchrun, in
interleaved rounds (benchmarks/device/rounds.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.device.report import ROOT, Report, launch, step_records
from benchmarks.device.rounds import Measured, Pair, interleave
from benchmarks.device.throughput import RATIO_TARGET

NANOGPT = {  # nanoGPT's shakespeare_char GPU configuration (6 x 6 x 384, context 256, batch 64), bf16
    "gpu": {"layers": 6, "heads": 6, "width": 384, "block": 256, "batch": 64, "dropout": 0.2, "iters": 160, "warmup": 40},
    "cpu": {"layers": 1, "heads": 2, "width": 32, "block": 32, "batch": 4, "dropout": 0.0, "iters": 12, "warmup": 4},
}
NANOGPT_SCRIPT = Path(__file__).resolve().with_name("nanogpt_like.py")


def nanogpt(mode: str, scratch: Path, report: Report, rounds: int = 1) -> None:
    """A nanoGPT-like script: with the run handle under launch.py against itself without the handle
    under torchrun, `rounds` interleaved rounds."""
    from benchmarks.device.nanogpt_like import token_file

    shape = NANOGPT[mode]
    data = scratch / "data"
    _, vocab = token_file(data)
    args = [f"--data={data}", *(f"--{k}={v}" for k, v in shape.items())]
    report.figure("set-up", f"benchmarks/device/nanogpt_like.py {' '.join(args[1:])}, {vocab}-character vocabulary, 1 rank, {rounds} rounds")
    where = ["resources.gpus_per_task=1", "cluster.gpus_per_node=1"] if mode == "gpu" else []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    toolkit_does = "python launch.py script=nanogpt_like.py resources.tasks_per_node=1 -- --handle: start_run, end_step every iteration, finish"
    reference_does = "torchrun --standalone --nproc-per-node 1 nanogpt_like.py: the same file without the handle; each times its iterations after the warm-up"

    def result(out: Path, handle: bool) -> Measured:
        figures = json.loads(out.read_text())
        if figures["handle"] is not handle or figures["iters_timed"] != shape["iters"] - shape["warmup"]:
            raise RuntimeError(f"{out}: {figures}, not {shape['iters'] - shape['warmup']} timed iterations {'with' if handle else 'without'} the handle")
        return Measured(float(figures["tokens_per_s"]))

    def toolkit(index: int) -> Measured:
        workdir = scratch / f"handle-{index + 1}"
        out = workdir / "result.json"
        run_dir = launch([f"script={NANOGPT_SCRIPT}", "resources.tasks_per_node=1", *where, "--", *args, "--handle", f"--out={out}"], workdir)
        logged = len(step_records(run_dir)) if (run_dir / "steps.jsonl").exists() else 0  # end_step's records: the handle ran every iteration
        if logged != shape["iters"]:
            raise RuntimeError(f"the run handle logged {logged} steps of {shape['iters']} in {run_dir}")
        return result(out, handle=True)

    def reference(index: int) -> Measured:
        workdir = scratch / f"torchrun-{index + 1}"
        workdir.mkdir(parents=True, exist_ok=True)
        out = workdir / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(NANOGPT_SCRIPT), *args, f"--out={out}"]
        done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"torchrun nanogpt_like.py failed (exit {done.returncode}): {(done.stdout + done.stderr).strip()[-1500:]}")
        return result(out, handle=False)

    interleave([Pair("nanogpt", "tokens/s", RATIO_TARGET["nanogpt"], toolkit_does, reference_does, toolkit, reference)], rounds, report)
