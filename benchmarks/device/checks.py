"""The device checks, one per process (the driver, benchmarks/device/__main__.py, starts them):

    python -m benchmarks.device.checks NAME --mode gpu|cpu --scratch DIR --result FILE.json [--rounds N]

GPU path (one rank, comm=nccl in gpu mode, gloo on the CPU in cpu mode). Throughput, the toolkit
against a reference in N interleaved rounds (benchmarks/device/throughput.py, nanogpt.py,
compiled.py): resnet50 (the trainer against a raw loop), lm (task=lm against a plain loop, and
its bf16 loss curve), nanogpt (a nanoGPT-like script with the run handle under launch.py against
the same script under torchrun), compile (lm and resnet50 with trainer.compile=true against the
loops compiled the same way). resume (a signal stop and resume, bit for bit), handle (a user's
DDP script with the run handle: nccl, a signal stop and resume, bit for bit), memory (bytes per
parameter, replicated and FSDP2), fsdp (comm.sharding=full through the trainer: a signal stop
and resume, bit for bit). CPU ranks (the machine's 16 cores): allreduce, scaling, loader
(benchmarks/device/cores.py). unit: the unit tier on the machine's torch.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

from benchmarks.device.compiled import compile_check
from benchmarks.device.cores import allreduce, loader, scaling
from benchmarks.device.nanogpt import nanogpt
from benchmarks.device.report import BUDGET_VARIABLE, ROOT, Report, device_overrides, launch, launch_command, step_records
from benchmarks.device.throughput import lm, resnet50
from benchmarks.rundirs import logged_steps, rank_pids, resume_command, run_dirs, state_hash, step_losses


def environment(mode: str, scratch: Path, report: Report) -> None:
    from mpi4py import MPI

    from collectives.mpirun import find_mpirun

    report.figure("python", platform.python_version())
    report.figure("torch", torch.__version__)
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        report.figure("GPU", f"{properties.name}, {properties.total_memory / 2**30:.0f} GiB, {properties.multi_processor_count} SMs")
        report.figure("CUDA (torch built with)", torch.version.cuda)
        report.figure("NCCL", ".".join(map(str, torch.cuda.nccl.version())))
        report.figure("cuDNN", torch.backends.cudnn.version())
    mpirun = find_mpirun()
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if mpirun else "none"
    report.figure("mpirun", f"{mpirun}: {version}")
    report.figure("MPI library", MPI.Get_library_version().splitlines()[0].strip())
    for package in ("mpi4py", "h5py", "numpy", "hydra-core", "omegaconf", "submitit", "python-hostlist", "torchvision"):
        try:
            report.figure(package, metadata.version(package))
        except metadata.PackageNotFoundError:
            report.figure(package, "missing")
    report.figure("CPU cores", os.cpu_count())


def resume(mode: str, scratch: Path, report: Report) -> None:
    """A run stopped by SIGUSR1 and resumed against an uninterrupted one: the same loss at every
    step and the same final weights, bit for bit. Crops and flips are drawn on the training device
    (the CUDA generator in gpu mode), and trainer.deterministic=true fixes the GPU's kernels."""
    job = [
        "model=cnn",
        "data.crop=8",
        "data.crop_padding=1",
        "data.flip=true",
        "data.batch_size=32",
        f"trainer.epochs={6 if mode == 'gpu' else 3}",
        "trainer.deterministic=true",
        "checkpoint.every_steps=20",
        "checkpoint.every_minutes=null",
        "resources.tasks_per_node=1",
        *device_overrides(mode),
    ]
    reference = launch(job, scratch / "reference")
    report.figure("uninterrupted steps", len(step_losses(reference)))
    stop_resume_and_compare(job, reference, scratch / "stopped", 30, report)


def fsdp(mode: str, scratch: Path, report: Report) -> None:
    """comm.sharding=full (FSDP2) through the trainer: the language-model task on one rank (NCCL
    on the GPU, gloo on the CPU), its blocks sharded, bf16, stopped by SIGUSR1 and resumed against
    an uninterrupted run (the same loss at every step, the same consolidated weights), and its
    first losses beside a replicated run's."""
    job = [
        "task=lm",
        "trainer.precision=bf16",
        "trainer.deterministic=true",
        f"trainer.max_steps={120 if mode == 'gpu' else 20}",
        "checkpoint.every_steps=25",
        "checkpoint.every_minutes=null",
        "resources.tasks_per_node=1",
        *device_overrides(mode),
    ]
    sharded = [*job, "comm.sharding=full"]
    reference = launch(sharded, scratch / "reference")
    replicated = step_losses(launch(job, scratch / "replicated"))
    ours = step_losses(reference)
    report.figure("uninterrupted steps", len(ours))
    report.figure("losses at steps 1, 10, last: FSDP2", [round(ours[s], 4) for s in (1, 10, max(ours))])
    report.figure("losses at steps 1, 10, last: replicated", [round(replicated[s], 4) for s in (1, 10, max(replicated))])
    stop_resume_and_compare(sharded, reference, scratch / "stopped", 40 if mode == "gpu" else 8, report)


def stop_resume_and_compare(overrides: list[str], reference: Path, workdir: Path, after_steps: int, report: Report) -> None:
    """The job of `overrides` started again, every rank sent SIGUSR1 after `after_steps` logged
    steps, resumed from command.txt to the end, and compared with the uninterrupted `reference`:
    the loss at every step and the final weights, bit for bit."""
    from hpc.rank.lifecycle import EXIT_RESUMABLE

    workdir.mkdir(parents=True, exist_ok=True)
    first = subprocess.Popen(
        launch_command(overrides, workdir),
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    run_dir = poll(lambda: next((d for d in run_dirs(workdir) if logged_steps(d) >= after_steps), None), first, f"{after_steps} logged steps")
    for pid in rank_pids(run_dir):
        os.kill(pid, signal.SIGUSR1)
    code = first.wait(timeout=120)
    if code != EXIT_RESUMABLE:
        raise RuntimeError(f"the signalled run exited {code}, not {EXIT_RESUMABLE} (resumable): {first.stderr.read()[-1500:] if first.stderr else ''}")
    report.figure("stopped by SIGUSR1 after step", max(step_losses(run_dir)))
    command, env = resume_command(run_dir)
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if resumed.returncode:
        raise RuntimeError(f"the resumed run failed (exit {resumed.returncode}): {resumed.stderr[-1500:]}")
    ours, theirs = step_losses(run_dir), step_losses(reference)
    differing = [s for s in theirs if ours.get(s) != theirs[s]]
    report.figure("steps compared", len(theirs))
    report.target("steps whose loss differs from the uninterrupted run", len(differing), "0", not differing)
    same = state_hash(run_dir) == state_hash(reference)
    report.target("final weights identical", same, "True", same)
    if differing:
        report.note(f"first differing step {differing[0]}: {ours.get(differing[0])!r} against {theirs[differing[0]]!r}")


def poll(found: Callable[[], Path | None], proc: subprocess.Popen[str], what: str, timeout_s: float = 120) -> Path:
    deadline = time.monotonic() + timeout_s
    while (result := found()) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before {what}: {proc.stderr.read()[-1500:] if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.01)  # polling the step log: there is no event to wait on
    return result


def handle(mode: str, scratch: Path, report: Report) -> None:
    """A user's own DDP script with the run handle (examples/own_loop/train.py: nccl and the GPU
    in gpu mode, gloo on the CPU) through launch.py on one rank: stopped by SIGUSR1 and resumed
    against an uninterrupted run, the same loss at every step and the same final weights; and the
    handle's time per step against the step itself."""
    script = ["script=" + str(ROOT / "examples" / "own_loop" / "train.py"), "resources.tasks_per_node=1", "checkpoint.every_minutes=null"]
    if mode == "gpu":
        script += ["resources.gpus_per_task=1", "cluster.gpus_per_node=1"]
    # The stop must land mid-training with steps to spare, or the run may end before the signal
    # (issue 46: a CPU run of 400 steps signalled after 100 finished first under load): on the
    # CPU, 1,000 steps of about 1 ms, signalled after 10.
    steps, stop_after = (400, 100) if mode == "gpu" else (1000, 10)
    args = ["--", "--steps", str(steps)]
    reference = launch([*script, *args], scratch / "reference")
    records = step_records(reference)
    report.figure("uninterrupted steps", len(records))
    report.figure("step ms (median, the script's own step with end_step)", round(statistics.median(r["step_ms"] for r in records[10:]), 3))
    stop_resume_and_compare([*script, *args], reference, scratch / "stopped", stop_after, report)


def memory(mode: str, scratch: Path, report: Report) -> None:
    """Memory accounting of one rank (issue 32): a GPT with fp32 AdamW, replicated and under
    FSDP2 (`fully_shard` per block, NCCL process group of one in gpu mode, gloo in cpu mode):
    bytes per parameter after building (parameters), after the first backward (+ gradients) and
    at the peak of three steps (+ AdamW's two moments and activations), against 4 / 8 / 16."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainers.gpt import GPT, GPTShape, next_token_loss

    gpu = mode == "gpu"
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    shape = GPTShape(vocab_size=256, context=256, layers=12, heads=16, width=1024) if gpu else GPTShape(vocab_size=256, context=32, layers=2, heads=4, width=64)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 500))
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1, **({"device_id": device} if gpu else {}))

    def allocated() -> float:
        if gpu:
            torch.cuda.synchronize()
            return float(torch.cuda.memory_allocated(device))
        from trainers.reporting.memory import peak_memory_mib

        return peak_memory_mib(device) * 2**20

    try:
        for variant in ("replicated", "fsdp2"):
            torch.manual_seed(0)
            if gpu:
                torch.zeros(1, device=device)  # the allocator exists: resetting its statistics before that fails
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            base = allocated()
            model = GPT(shape).to(device)
            if variant == "fsdp2":
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            params = sum(p.numel() for p in model.parameters())
            built = allocated() - base
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.randint(0, shape.vocab_size, (8, shape.context + 1), device=device)
            losses, after_backward = [], 0.0
            started = time.perf_counter()
            for step in range(3):
                loss = next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                if step == 0:
                    after_backward = allocated() - base
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss))
            seconds = time.perf_counter() - started
            peak = (torch.cuda.max_memory_allocated(device) if gpu else allocated()) - base
            report.figure(f"{variant}: parameters", params)
            report.figure(f"{variant}: bytes/param built (theory 4)", round(built / params, 2))
            report.figure(f"{variant}: bytes/param after backward (theory 8 + activations freed)", round(after_backward / params, 2))
            report.figure(f"{variant}: bytes/param at the peak (theory 16 + activations)", round(peak / params, 2))
            report.figure(f"{variant}: losses of 3 steps", [round(x, 4) for x in losses])
            report.figure(f"{variant}: s for 3 steps", round(seconds, 3))
            del model, optimizer
    finally:
        dist.destroy_process_group()


def unit(mode: str, scratch: Path, report: Report) -> None:
    """The unit tier on this machine's torch (the GPU machine's may be older than the pinned one)."""
    if mode == "cpu":
        report.finish("skipped", "cpu mode: CI runs the unit tier itself")
        raise SystemExit(0)
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-n", "14", "tests/unit"]
    output = scratch.with_suffix(".pytest.txt")
    with output.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            proc.wait(timeout=float(os.environ.get(BUDGET_VARIABLE, "600")) - 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            report.note("pytest was stopped 10 s before the check's budget: the lines below are what it had reported")
    lines = output.read_text().strip().splitlines()
    print("\n".join(lines[-300:]))  # into the check's log (logs.txt): the failures' tracebacks and summary
    report.figure("pytest tests/unit", lines[-1] if lines else f"no output (exit {proc.returncode})")
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    for line in failures[:20]:
        report.note(line[:300])


# A new process's start on this machine, against a group started again in the same process.
RESTART_PROBE = """
import datetime, json, sys, time
began = time.perf_counter()
import torch, torch.distributed as dist
imported = time.perf_counter()
gpu = sys.argv[1] == "gpu"
if gpu:
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
context = time.perf_counter()
def group(port):
    started = time.perf_counter()
    dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    x = torch.ones(1 << 20, device="cuda" if gpu else "cpu")
    dist.all_reduce(x)
    if gpu:
        torch.cuda.synchronize()
    ready = time.perf_counter()
    dist.destroy_process_group()
    return ready - started
first, again = group(int(sys.argv[2])), group(int(sys.argv[3]))
print(json.dumps({"import": imported - began, "context": context - imported, "first": first, "again": again}))
"""


def restart(mode: str, scratch: Path, report: Report) -> None:
    """What an in-process restart (hpc.rank.parking) keeps on this machine: a new process's
    torch import and CUDA context, and the group's first start and collective (NCCL on the GPU,
    Gloo on the CPU; one rank) against the same started again in that process. A fork of the
    warm process skips the import, not the context (CUDA cannot be forked)."""
    import json
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            ports.append(str(free.getsockname()[1]))
    rounds = []
    for _ in range(3):  # interleaved with nothing: each a fresh process, the median reported
        done = subprocess.run([sys.executable, "-c", RESTART_PROBE, mode, *ports], capture_output=True, text=True, timeout=240, check=True)
        rounds.append(json.loads(done.stdout.strip().splitlines()[-1]))
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    report.figure("import torch (s, a cold rank's; a fork skips it)", round(median["import"], 3))
    report.figure("CUDA context (s, every fork's; an in-process restart skips it)", round(median["context"], 3))
    report.figure("group start + first allreduce, new process (s)", round(median["first"], 3))
    report.figure("group start + first allreduce, again in the same process (s)", round(median["again"], 3))
    report.figure("an in-process restart saves over a fork (s)", round(median["context"] + median["first"] - median["again"], 3))


CHECKS: dict[str, Callable[[str, Path, Report], None]] = {
    "environment": environment,
    "resume": resume,
    "handle": handle,
    "memory": memory,
    "fsdp": fsdp,
    "allreduce": allreduce,
    "scaling": scaling,
    "loader": loader,
    "unit": unit,
    "restart": restart,
}
ROUND_CHECKS: dict[str, Callable[[str, Path, Report, int], None]] = {  # the toolkit against a reference, in --rounds rounds
    "resnet50": resnet50,
    "lm": lm,
    "nanogpt": nanogpt,
    "compile": compile_check,
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device.checks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=[*CHECKS, *ROUND_CHECKS])
    parser.add_argument("--mode", choices=("gpu", "cpu"), required=True)
    parser.add_argument("--scratch", type=Path, required=True)
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the throughput checks (" + ", ".join(ROUND_CHECKS) + ")")
    args = parser.parse_args(argv)
    report = Report(args.result)
    try:
        if args.name in ROUND_CHECKS:
            ROUND_CHECKS[args.name](args.mode, args.scratch, report, args.rounds)
        else:
            CHECKS[args.name](args.mode, args.scratch, report)
    except Exception as err:  # noqa: BLE001  # any failure is this check's result, named
        report.finish("failed", f"{type(err).__name__}: {str(err)[-1500:]}")
        raise
    report.finish("ok" if all(t["met"] for t in report.data["targets"].values()) else "missed a target")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
