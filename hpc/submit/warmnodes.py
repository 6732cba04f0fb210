"""The warm processes of a Slurm job's nodes (hpc.rank.warm), as the step supervisor starts and
ends them: one one-task srun step per node of the allocation, spares included, started before
the ranks' first step and kept for the job's life, so a rank started again in the allocation is
a fork of a process that has torch imported (hpc.submit.supervise).

One step per node, not one for all: Slurm ends a step whose node fails, with every process forked
in it on every node, and the ranks a warm process forked on a live node must outlive a lost one.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc.env import WARM_VARIABLE, job_cpus_per_node
from hpc.slurmctl import task_per_node

STEP_NAME = "hpc-warm"  # srun --job-name of the warm steps: a failed rank's step is killed, never these


def warm_program(srun: Sequence[str]) -> list[str] | None:
    """The warm process's command for the ranks' srun line (`... PYTHON -u -m hpc.rank.main
    RUN_DIR`): the same interpreter. None for a line that runs the ranks through a container
    runtime or any other wrapper (their ranks start cold)."""
    words = list(srun)
    try:
        at = words.index("hpc.rank.main")
    except ValueError:
        return None
    if at < 3 or words[at - 1] != "-m" or words[at - 2] != "-u":
        return None
    python = words[at - 3]
    if not (Path(python).is_absolute() and Path(python).name.startswith("python")):
        return None
    return [python, "-u", "-m", "hpc.rank.warm"]


def warm_step(node: str, program: Sequence[str], gpus: int = 0, cpus: int | None = None) -> list[str]:
    """The srun line of `node`'s warm step. It asks for the node's CPUs (and `gpus`), shared
    with the ranks' step (--overlap): where Slurm confines a step to what it asked for (cgroups),
    its forks, which live in its cgroup, can use the CPUs and GPUs their tasks were given."""
    srun, *rest = task_per_node([node], *program)
    asks = [*([f"--cpus-per-task={cpus}"] if cpus else []), *([f"--gres=gpu:{gpus}"] if gpus else [])]
    return [srun, f"--job-name={STEP_NAME}", *asks, *rest]


class WarmNodes:
    """The warm steps of `nodes`, each read for a `failed` line (said in the batch log once)."""

    def __init__(self, nodes: Sequence[str], program: Sequence[str], env: Mapping[str, str], gpus: int = 0) -> None:
        cpus = job_cpus_per_node(env)
        self.token = secrets.token_hex(16)
        self.failed: dict[str, str] = {}  # node -> why it has no warm process now
        self.broken: set[str] = set()  # nodes whose warm process said it cannot work (not started again)
        self.steps: dict[str, subprocess.Popen[str]] = {}
        self._lock = threading.Lock()
        self.program, self.gpus, self.cpus = list(program), gpus, cpus
        self.step_env = {**env, WARM_VARIABLE: self.token}
        for node in nodes:
            self._start(node)

    def _start(self, node: str) -> None:
        try:
            command = warm_step(node, self.program, self.gpus, self.cpus)
            step = subprocess.Popen(command, env=self.step_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, errors="replace")
        except OSError as err:
            with self._lock:
                self.failed[node] = f"srun: {err}"
            return
        with self._lock:
            self.steps[node] = step
            self.failed.pop(node, None)
        threading.Thread(target=self._read, args=(node, step), daemon=True, name=f"warm-{node}").start()

    def revive(self, nodes: Sequence[str]) -> None:
        """Start again the warm steps of `nodes` that ended (a kill of all the job's steps took
        them): the restart's tasks wait for them to listen, and queue while they import."""
        for node in nodes:
            step = self.steps.get(node)
            if step is not None and step.poll() is not None and node not in self.broken:
                self._start(node)

    def _read(self, node: str, step: subprocess.Popen[str]) -> None:
        assert step.stdout is not None
        for line in step.stdout:
            words = line.split()
            if words[:2] == ["hpc-warm:", "failed"]:
                with self._lock:
                    self.failed[node] = line.strip()
                    self.broken.add(node)
                print(f"hpc-toolkit: warm ranks: {line.strip()}; the ranks there start cold", file=sys.stderr, flush=True)
        step.wait()
        with self._lock:
            if self.steps.get(node) is step:  # not one revived since
                self.failed.setdefault(node, f"its warm step ended (srun exit {step.returncode})")

    def env(self) -> dict[str, str]:
        """What the ranks' step adds to its environment: the token, while a warm step runs (the
        first step starts beside them: its tasks wait for their warm process to listen)."""
        with self._lock:
            return {WARM_VARIABLE: self.token} if set(self.steps) - set(self.failed) else {}

    def stop(self) -> None:
        """End every warm step: its standard input closed, the warm process returns and srun ends
        without a word; one that has not ended in 2 s is killed."""
        for step in self.steps.values():
            if step.stdin is not None:
                with contextlib.suppress(OSError):
                    step.stdin.close()
        deadline = time.monotonic() + 2.0
        for step in self.steps.values():
            try:
                step.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                step.kill()
                step.wait()
