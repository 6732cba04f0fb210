"""Run the device checks in order, each in a process of its own under its own time budget, and
keep summary.json + summary.md under --out current after every check (see the package docstring).

    python3 -m benchmarks.device --out DIR [--mode gpu|cpu] [--only a,b] [--rounds N] [--rounds name=N] [--deadline-s 450] [--budget name=seconds]

Issue 43's command, ready for one call on a lent H100 or H200 (about 9 minutes of the session's
15 minutes of device time; not yet measured: no device lent on 2026-11-27). First, here:
benchmarks/device/wheels.sh, and the call carries .device (run(carry=[".device"])). There:

    python3 -m benchmarks.device --out "$OUT" --only environment,resnet50,lm,nanogpt,compile,resume,handle --rounds 5 --rounds compile=1 --deadline-s 540

resnet50, lm and nanogpt: 5 interleaved rounds each of the toolkit against its reference (per
pair the median ratio, its spread and the data wait, against issue 43's targets); compile:
trainer.compile=true against the reference loops compiled the same way (one round: the cold
compiles take most of its budget); resume and handle: bit-identical after a stop, last because
they are the cheapest to repeat (`--only resume,handle`, about 100 s) in the minutes left.
Estimated on the GPU machine from the figures in docs/benchmarks.md (ResNet-50 about 4,000
img/s at batch 256, lm about 1.2M tokens/s, nanoGPT's shakespeare_char step about 11 ms, a
launch.py run about 12 s before its first step, torchrun about 7 s), in seconds:

    setup + environment 15 | resnet50 5 x 21 + 10 = 115 | lm 5 x 18.5 + 3 = 95 | nanogpt 5 x 23 = 115
    compile 70 (the references' cold compiles) + 60-95 (one round) | resume 50 | handle 45
    in all 560-600 s at 12 s a launch, 490-530 s at 9 s: the deadline (540 s) skips what is left

The other checks (memory, fsdp, allreduce, scaling, loader, unit) were measured on 2026-11-26
and are left out: they took 6.5 minutes by themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.device.report import BUDGET_VARIABLE
from benchmarks.device.summary import render_markdown, render_pairs

ROOT = Path(__file__).resolve().parents[2]
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
WHEELS = ROOT / ".device" / "wheels"  # benchmarks/device/wheels.sh fills it; carried to the GPU machine
CARRIED = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit", "python-hostlist")
# In order of value (issue 43's first); seconds each may take on the GPU machine at one round (the
# CPU mode's are its own). The throughput checks get ROUND_S more for each further --rounds round.
BUDGET_S = {
    "environment": 30,
    "resnet50": 60,
    "lm": 45,
    "nanogpt": 50,
    "compile": 240,  # measured: the references compile in 28 + 50 s, a compiled lm round 37 s
    "resume": 100,
    "handle": 60,
    "memory": 40,
    "fsdp": 120,
    "allreduce": 100,
    "scaling": 110,
    "loader": 45,
    "unit": 90,
    "restart": 60,
}
# The CPU plumbing mode runs beside other tests on 2 cores (CI, three test workers): 2.5-4x each check's time alone there.
CPU_BUDGET_S = {
    "environment": 60,
    "resnet50": 200,
    "lm": 150,
    "nanogpt": 120,
    "compile": 300,
    "resume": 200,
    "handle": 240,  # 39 s alone (three launches); three test workers and a busy machine stretched it past 130 (2026-12-03)
    "memory": 60,
    "fsdp": 300,
    "allreduce": 150,
    "scaling": 150,
    "loader": 100,
    "unit": 20,
    "restart": 60,
}
ROUND_CHECKS = ("resnet50", "lm", "nanogpt", "compile")  # the toolkit against a reference, in interleaved rounds
ROUND_S = {"resnet50": 25, "lm": 22, "nanogpt": 40, "compile": 60}  # GPU: a round's time (H200, 2026-11-27: nanogpt 33-38 s) and a margin
CPU_ROUND_S = {"resnet50": 60, "lm": 50, "nanogpt": 60, "compile": 90}


class Stopped(Exception):
    """The command itself was signalled (the device call's limit): report what finished."""


def install_carried_wheels() -> dict[str, Any]:
    """Hydra, omegaconf, submitit and python-hostlist from the carried wheels, offline, where they
    do not import (the GPU machine reaches no package registry)."""
    missing = [m for m in ("hydra", "omegaconf", "submitit", "hostlist") if importlib.util.find_spec(m) is None]
    if not missing:
        return {"status": "ok", "figures": {"installed": "nothing: all import"}}
    if not WHEELS.is_dir():
        return {"status": "failed", "error": f"{', '.join(missing)} do not import and {WHEELS} is missing: run benchmarks/device/wheels.sh first"}
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", str(WHEELS), *CARRIED]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"status": "failed", "error": f"pip install from {WHEELS} failed: {done.stderr.strip()[-400:]}"}
    return {"status": "ok", "figures": {"installed": ", ".join(CARRIED)}}


def run_check(name: str, mode: str, budget_s: float, scratch: Path, rounds: int = 1) -> dict[str, Any]:
    """One check in a process of its own; killed with all its descendants when over budget. The check
    writes its result file as it goes, so a killed check still reports the parts it finished."""
    result_file = scratch / f"{name}.json"
    command = [sys.executable, "-m", "benchmarks.device.checks", name, "--mode", mode, "--scratch", str(scratch / name), "--result", str(result_file)]
    command += ["--rounds", str(rounds)]
    log = (scratch / f"{name}.log").open("w")
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT), BUDGET_VARIABLE: str(budget_s)}
    )
    status, signalled = None, ""
    try:
        proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        status = "timed out"
    except Stopped as why:
        status = "killed"
        signalled = str(why)
    finally:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # a second signal must not stop the cleanup halfway
        try:
            if proc.poll() is None:  # over budget, or the command was signalled
                kill_tree(proc.pid)
            proc.wait()
            for orphan in children_of(os.getpid()):  # what the check left behind came to us (a subreaper)
                kill_tree(orphan)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        log.close()
    entry: dict[str, Any] = json.loads(result_file.read_text()) if result_file.exists() else {}
    entry["seconds"] = round(time.monotonic() - started, 1)
    entry["budget_s"] = budget_s
    if status is not None:
        entry["status"] = status
        cause = f"the command got {signalled}" if signalled else f"over its budget of {budget_s:.0f} s"
        entry.setdefault("error", f"{status} after {entry['seconds']:.0f} s ({cause}); the figures shown finished before")
    elif proc.returncode != 0 or "status" not in entry:
        entry["status"] = "failed"
        tail = (scratch / f"{name}.log").read_text().strip().splitlines()[-12:]
        entry.setdefault("error", f"exit {proc.returncode}: " + " | ".join(tail))
    if entry["status"] != "ok":
        entry["log_tail"] = (scratch / f"{name}.log").read_text()[-4000:]
    return entry


def become_subreaper() -> None:
    """Processes a check leaves behind (a launch it gave up waiting for, pytest's workers) are
    re-parented to this process instead of init, so the cleanup after each check finds them."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)


def children_of(parent: int) -> list[int]:
    return [pid for pid, ppid in process_parents().items() if ppid == parent]


def process_parents() -> dict[int, int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return parents


def kill_tree(root: int) -> None:
    """SIGKILL `root` and every process below it. launch.py starts mpirun in a session of its own
    (a terminal's Ctrl-C must not reach it), so a process group does not hold the ranks: the
    tree is frozen (SIGSTOP) until no new child appears, then killed, so nothing is orphaned."""
    frozen: set[int] = set()
    while True:
        children: dict[int, list[int]] = {}
        for pid, ppid in process_parents().items():
            children.setdefault(ppid, []).append(pid)
        tree, todo = set(), [root]
        while todo:
            pid = todo.pop()
            tree.add(pid)
            todo += children.get(pid, [])
        if tree <= frozen:
            break
        for pid in tree - frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        frozen |= tree
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    for name, text in (("summary.json", json.dumps(summary, indent=1)), ("summary.md", render_markdown(summary))):
        temporary = out / f".{name}.tmp"
        temporary.write_text(text)
        temporary.replace(out / name)  # a reader (or a kill) never sees half a summary


def parse_rounds(values: list[str]) -> dict[str, int]:
    """`--rounds N` (every throughput check) and `--rounds NAME=N` (one), later ones winning."""
    rounds = dict.fromkeys(ROUND_CHECKS, 1)
    for value in values:
        name, _, count = value.rpartition("=")
        if name not in ("", *ROUND_CHECKS) or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"error: --rounds {value!r}: want N or NAME=N, N >= 1, NAME one of {', '.join(ROUND_CHECKS)}")
        rounds.update({name: int(count)} if name else dict.fromkeys(ROUND_CHECKS, int(count)))
    return rounds


def round_budgets(budgets: Mapping[str, float], per_round: Mapping[str, float], rounds: Mapping[str, int]) -> dict[str, float]:
    """Each check's budget at its rounds: the throughput checks' grow by a round's time each."""
    return {name: seconds + per_round.get(name, 0) * (rounds.get(name, 1) - 1) for name, seconds in budgets.items()}


def parse_budgets(pairs: list[str], budgets: dict[str, float]) -> dict[str, float]:
    chosen = dict(budgets)
    for pair in pairs:
        name, _, seconds = pair.partition("=")
        if name not in chosen or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"error: --budget {pair!r}: want NAME=SECONDS with NAME one of {', '.join(chosen)}")
        chosen[name] = float(seconds)
    return chosen


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="summary.json, summary.md and logs.txt (every check's output) go here")
    parser.add_argument("--scratch", type=Path, default=None, help="data, runs and each check's files (default: a new temporary folder)")
    parser.add_argument("--mode", choices=("gpu", "cpu"), default=None, help="gpu (default where CUDA is there) or cpu: tiny, for CI")
    parser.add_argument("--only", default=None, help=f"comma list of checks (default all: {','.join(BUDGET_S)})")
    parser.add_argument(
        "--rounds", action="append", default=[], metavar="N|NAME=N", help=f"interleaved rounds of the throughput checks ({', '.join(ROUND_CHECKS)}; default 1)"
    )
    parser.add_argument("--deadline-s", type=float, default=450.0, help="no check starts or runs past this many seconds from the start")
    parser.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS", help="override one check's budget")
    args = parser.parse_args(argv)
    rounds = parse_rounds(args.rounds)
    mode = args.mode or ("gpu" if _cuda_available() else "cpu")
    gpu = mode == "gpu"
    budgets = parse_budgets(args.budget, round_budgets(BUDGET_S if gpu else CPU_BUDGET_S, ROUND_S if gpu else CPU_ROUND_S, rounds))
    names = [n.strip() for n in (args.only or ",".join(budgets)).split(",") if n.strip()]
    unknown = [n for n in names if n not in budgets]
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {', '.join(budgets)}")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="device-checks-"))
    scratch.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, _frame: object) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    become_subreaper()
    started = time.monotonic()
    summary: dict[str, Any] = {
        "mode": mode,
        "command": "python3 -m benchmarks.device " + " ".join(argv),
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cores": os.cpu_count(),
        "checks": {name: {"status": "not run"} for name in ["setup", *names]},
    }
    write_summary(args.out, summary)
    planned = ", ".join(f"{n} {budgets[n]:.0f} s" + (f" ({rounds[n]} rounds)" if n in rounds else "") for n in names)
    print(f"{mode} mode, deadline {args.deadline_s:.0f} s; budgets: {planned}", flush=True)
    try:
        summary["checks"]["setup"] = install_carried_wheels()
        write_summary(args.out, summary)
        for name in names:
            left = args.deadline_s - (time.monotonic() - started)
            if left < 10:
                summary["checks"][name] = {"status": "skipped", "error": f"the command's deadline ({args.deadline_s:.0f} s) was reached"}
                continue
            summary["checks"][name] = {"status": "running"}
            write_summary(args.out, summary)
            summary["checks"][name] = run_check(name, mode, min(budgets[name], left), scratch, rounds.get(name, 1))
            write_summary(args.out, summary)
            check = summary["checks"][name]
            elapsed = time.monotonic() - started
            print(f"[{elapsed:4.0f} s] {name}: {check['status']}, {check['seconds']:.0f} s of its {check['budget_s']:.0f} s budget", flush=True)
            with (args.out / "logs.txt").open("a") as logs:
                logs.write(f"===== {name}: {summary['checks'][name]['status']}\n{(scratch / f'{name}.log').read_text()[-20000:]}\n")
            if summary["checks"][name]["status"] == "killed":
                break  # the command itself was signalled: the later checks stay "not run"
    except Stopped as why:
        running = [n for n, c in summary["checks"].items() if c.get("status") == "running"]
        for name in running:
            summary["checks"][name] = {"status": "killed", "error": f"the command got {why} while this check ran"}
    summary["seconds"] = round(time.monotonic() - started, 1)
    write_summary(args.out, summary)
    print(render_markdown(summary))
    recap = [f"{name}: {c['status']}" + (f", {c['seconds']:.0f} s" if "seconds" in c else "") for name, c in summary["checks"].items()]
    print("\n".join(["", "Recap (a device call returns the output's tail):", *render_pairs(summary["checks"]), *recap, f"in all {summary['seconds']:.0f} s"]))
    return 0 if all(c["status"] in ("ok", "skipped") for c in summary["checks"].values()) else 1


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
