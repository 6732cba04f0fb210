"""The warm processes of a Slurm job's nodes (hpc.rank.warm): one one-task srun step per node of
the allocation, spares included, started before the ranks' first step and kept for the job's
life, so a rank started again in the allocation is a fork of a process that has torch imported
(hpc.slurm.supervise).

The batch script starts them itself, at its last setup line (batch_start_lines), before submitit's
Python and the step supervisor start: their imports overlap that start, which is most of a
requeued job's wait before its ranks. The supervisor adopts them (WarmNodes.adopt) and starts
again those a job-wide kill took; a supervisor run by hand starts its own.

One step per node, not one for all: Slurm ends a step whose node fails, with every process forked
in it on every node, and the ranks a warm process forked on a live node must outlive a lost one.
"""

from __future__ import annotations

import contextlib
import secrets
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpc.env import WARM_DIR_VARIABLE, WARM_RANKS_VARIABLE, WARM_VARIABLE
from hpc.slurm.environment import job_cpus_per_node, restart_count, slurm_job_id
from hpc.slurm.slurmctl import task_per_node

STEP_NAME = "hpc-warm"  # srun --job-name of the warm steps: a failed rank's step is killed, never these
# The EXIT trap's call (hpc.slurm.batch.exit_trap_lines) of what batch_start_lines defines.
END_CALL = "[[ -n ${hpctk_warm_in:-} ]] && hpctk_warm_end"


def said_failure(line: str) -> bool:
    """Whether a warm process's output line says it cannot work (its ranks start cold)."""
    return line.split()[:2] == ["hpc-warm:", "failed"]


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


def batch_start_lines(program: Sequence[str], gpus: int = 0) -> list[str]:
    """The batch script's lines that start every node's warm step at once, in the background
    (after the user's setup lines: the same environment as the ranks). Each step's standard
    input is a FIFO that the script holds open until its EXIT trap (exit_trap_lines calls
    `hpctk_warm_end`, which closes it and waits for them); its output, and the node and srun pid, go to $HPCTK_WARM_DIR, where the
    supervisor reads them. The CPUs asked are the fewest the job holds on a node, as
    WarmNodes asks (job_cpus_per_node)."""
    line = shlex.join(warm_step("@NODE@", program, gpus)).replace("--nodelist=@NODE@", '--nodelist="$node"')
    line = line.replace(f"--job-name={STEP_NAME}", f"--job-name={STEP_NAME} ${{cpus:+--cpus-per-task=$cpus}}", 1)
    return [
        "hpctk_warm_start() {  # every node's warm process (hpc.rank.warm): its imports overlap submitit's and the supervisor's start",
        "    local dir node n cpus= IFS=$' \\t\\n'  # the user's setup lines may have changed IFS",
        '    dir=$(mktemp -d "${TMPDIR:-/tmp}/hpctk-warm.XXXXXX") && mkfifo "$dir/in" || return 0',
        '    echo "job $SLURM_JOB_ID ${SLURM_RESTART_COUNT:-0}" >"$dir/steps"  # whose: only this start of this job adopts them',
        '    exec {hpctk_warm_in}<>"$dir/in"  # held until the EXIT trap: the warm processes end when it closes',
        "    for n in ${SLURM_JOB_CPUS_PER_NODE//,/ }; do n=${n%%(*}; [[ $n =~ ^[0-9]+$ ]] && (( !cpus || n < cpus )) && cpus=$n; done",
        f"    export {WARM_VARIABLE}=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n') {WARM_DIR_VARIABLE}=$dir",
        '    for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        f'        {line} <"$dir/in" >"$dir/$node.out" {{hpctk_warm_in}}>&- &  # its stderr: the batch log',
        '        echo "$node $!" >>"$dir/steps"',
        '        hpctk_warm_pids+=("$!")',
        "    done",
        "}",
        "hpctk_warm_end() {  # from the EXIT trap: their input closed, they end on their own (10 s at most: a loaded node) before a requeue cancels them",
        "    local pid tries",
        "    exec {hpctk_warm_in}>&-",
        '    for pid in "${hpctk_warm_pids[@]}"; do',
        '        for (( tries = 0; tries < 200; tries++ )); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done',
        "    done",
        f'    rm -rf "${WARM_DIR_VARIABLE}"',
        "}",
        f"[[ ${{{WARM_RANKS_VARIABLE}:-0}} == 1 && -n ${{SLURM_JOB_NODELIST:-}} && -z ${{hpctk_warm_in:-}} ]] && hpctk_warm_start",
    ]


class BatchStep:
    """A warm step the batch script started (batch_start_lines): not this process's child, so
    known by its srun's pid and its output file."""

    def __init__(self, node: str, pid: int, output: Path) -> None:
        self.node, self.pid, self.output = node, pid, output
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _srun_alive(self.pid, self.node):
            self.returncode = 0  # its exit code is its parent's (the batch shell) to know
        return self.returncode

    def lines(self) -> list[str]:
        try:
            return self.output.read_text(errors="replace").splitlines()
        except OSError:
            return []


def _srun_alive(pid: int, node: str) -> bool:
    """Whether `pid` still is the srun of `node`'s warm step: running (not a zombie), and its
    arguments say so (not a pid used again since, by another of the job's sruns)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z" and {f"--job-name={STEP_NAME}".encode(), f"--nodelist={node}".encode()} <= set(words)


class WarmNodes:
    """The warm steps of `nodes`, each read for a `failed` line (said in the batch log once)."""

    def __init__(self, nodes: Sequence[str], program: Sequence[str], env: Mapping[str, str], gpus: int = 0, token: str | None = None) -> None:
        cpus = job_cpus_per_node(env)
        self.token = token or secrets.token_hex(16)
        self.failed: dict[str, str] = {}  # node -> why it has no warm process now
        self.broken: set[str] = set()  # nodes whose warm process said it cannot work (not started again)
        self.steps: dict[str, subprocess.Popen[str] | BatchStep] = {}
        self._lock = threading.Lock()
        self.program, self.gpus, self.cpus = list(program), gpus, cpus
        self.step_env = {**env, WARM_VARIABLE: self.token}
        for node in nodes:
            self._start(node)

    @classmethod
    def adopt(cls, program: Sequence[str], env: Mapping[str, str], gpus: int = 0) -> WarmNodes | None:
        """The warm steps the batch script started (batch_start_lines), from what it left in
        $HPCTK_WARM_DIR; None where it started none."""
        directory, token = env.get(WARM_DIR_VARIABLE), env.get(WARM_VARIABLE)
        if not directory or not token:
            return None
        try:
            rows = [line.split() for line in (Path(directory) / "steps").read_text().splitlines()]
        except OSError:
            return None
        if not rows or rows[0] != ["job", slurm_job_id(env) or "", str(restart_count(env))]:
            return None  # an enclosing job's, or an earlier start's: never another job's warm processes
        started = {row[0]: BatchStep(row[0], int(row[1]), Path(directory) / f"{row[0]}.out") for row in rows[1:] if len(row) == 2 and row[1].isdigit()}
        if not started:
            return None
        warm = cls([], program, env, gpus, token)
        warm.steps.update(started)
        return warm

    def _look_at_batch_steps(self) -> None:
        """What the batch script's warm steps said and whether their srun still runs."""
        for node, step in list(self.steps.items()):
            if not isinstance(step, BatchStep) or node in self.failed:
                continue
            said = step.lines()
            failure = next((line.strip() for line in said if said_failure(line)), None)
            if failure is not None:
                self._said_failed(node, failure)
            elif step.poll() is not None:
                with self._lock:
                    self.failed.setdefault(node, "its warm step ended")
                    if not any(line.startswith("hpc-warm: listening") for line in said):
                        self.broken.add(node)  # srun refused it (options, an old Slurm): never started again

    def _said_failed(self, node: str, line: str) -> None:
        with self._lock:
            self.failed[node] = line
            self.broken.add(node)
        print(f"hpc-toolkit: warm ranks: {line}; the ranks there start cold", file=sys.stderr, flush=True)

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
        self._look_at_batch_steps()
        for node in nodes:
            step = self.steps.get(node)
            if step is not None and step.poll() is not None and node not in self.broken:
                self._start(node)

    def _read(self, node: str, step: subprocess.Popen[str]) -> None:
        assert step.stdout is not None
        for line in step.stdout:
            if said_failure(line):
                self._said_failed(node, line.strip())
        step.wait()
        with self._lock:
            if self.steps.get(node) is step:  # not one revived since
                self.failed.setdefault(node, f"its warm step ended (srun exit {step.returncode})")

    def env(self) -> dict[str, str]:
        """What the ranks' step adds to its environment: the token, while a warm step runs (the
        first step starts beside them: its tasks wait for their warm process to listen)."""
        self._look_at_batch_steps()
        with self._lock:
            return {WARM_VARIABLE: self.token} if set(self.steps) - set(self.failed) else {}

    def stop(self) -> None:
        """End every warm step: its standard input closed, the warm process returns and srun ends
        without a word; one that has not ended in 2 s is killed. The batch script's own end
        when it closes their FIFO (its EXIT trap), once this process has returned."""
        mine = [step for step in self.steps.values() if isinstance(step, subprocess.Popen)]
        for step in mine:
            if step.stdin is not None:
                with contextlib.suppress(OSError):
                    step.stdin.close()
        deadline = time.monotonic() + 2.0
        for step in mine:
            try:
                step.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                step.kill()
                step.wait()
