"""A check's result file, rewritten on every figure: a check killed over its budget still leaves
the figures it had measured. Also the one way the checks start the trainer through launch.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.rundirs import run_dirs

ROOT = Path(__file__).resolve().parents[2]
BUDGET_VARIABLE = "HPCTK_DEVICE_CHECK_BUDGET_S"  # the seconds the driver gives the check


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.started = time.monotonic()
        self.data: dict[str, Any] = {"status": "running", "figures": {}, "targets": {}, "pairs": {}, "tables": [], "notes": []}
        self.save()

    def seconds_left(self) -> float:
        """Of the budget the driver gave this check (a check started by hand has no end)."""
        budget = float(os.environ.get(BUDGET_VARIABLE, "inf"))
        return budget - (time.monotonic() - self.started)

    def figure(self, name: str, value: Any) -> None:
        self.data["figures"][name] = value
        self.save()

    def target(self, name: str, value: float, wanted: str, met: bool) -> None:
        self.data["targets"][name] = {"value": value, "target": wanted, "met": bool(met)}
        self.save()

    def pair(self, name: str, summary: dict[str, Any]) -> None:
        """A toolkit run against its reference over interleaved rounds (benchmarks/device/rounds.py)."""
        self.data["pairs"][name] = summary
        self.save()

    def table(self, markdown: str) -> None:
        self.data["tables"].append(markdown)
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def finish(self, status: str = "ok", error: str | None = None) -> None:
        self.data["status"] = status
        if error:
            self.data["error"] = error
        self.save()

    def save(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        temporary.replace(self.path)


def device_overrides(mode: str) -> list[str]:
    """The job's backend and resources: one rank on the GPU with NCCL, or Gloo on the CPU."""
    if mode == "gpu":
        return ["comm=nccl", "resources.gpus_per_task=1", "cluster.gpus_per_node=1"]
    return ["comm=gloo"]


def launch_command(overrides: list[str], workdir: Path) -> list[str]:
    """`python launch.py OVERRIDES` with its run dirs under `workdir` (a script's own arguments, after `--`, last)."""
    at = overrides.index("--") if "--" in overrides else len(overrides)
    return [sys.executable, str(ROOT / "launch.py"), *overrides[:at], f"run_root={workdir / 'runs'}", *overrides[at:]]


def launch(overrides: list[str], workdir: Path, timeout_s: float = 600) -> Path:
    """`python launch.py OVERRIDES` (local ranks) to the end; its run dir. A failed run raises
    with the tail of its output."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = launch_command(overrides, workdir)
    done = subprocess.run(command, capture_output=True, text=True, cwd=workdir, timeout=timeout_s, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        raise RuntimeError(f"launch.py {' '.join(overrides)} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    (run_dir,) = run_dirs(workdir)
    return run_dir


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
