"""The step supervisor: what the batch step runs in place of a bare srun (submitit runs
`supervise_step(srun line)` there; by hand: `python -m hpc.slurm.supervise srun ARGS...`).

It runs the ranks' step. When a rank dies or stalls, it starts the ranks again in the same
allocation at once, and they resume from the newest committed checkpoint: no requeue, no queue
wait. It restarts only when srun failed and no rank finished the training, asked for a requeue
(a preemption, the time limit) or hit an error that would repeat. Nodes that no longer answer,
and a node where the first rank died in two steps in a row, are left out of the next step
(`srun --exclude`). So a job submitted with `resources.spare_nodes=K` (K extra nodes, sbatch
--no-kill) replaces a lost node by a spare.

Bounded: at most HPCTK_ALLOCATION_RESTARTS restarts in one start of the job, and none after
NO_PROGRESS_LIMIT restarts in a row that committed no new checkpoint. When it gives up it
returns srun's exit code and the EXIT trap falls back to requeueing the job
(hpc.slurm.batch.exit_trap_lines), which counts against `cluster.failure_requeues`.

A lost node hangs srun: Slurm ends the step only once it declares the node DOWN (SlurmdTimeout,
60 to 300 s), and until then srun reports nothing, while the ranks left wait in a collective. So
each rank holds a connection to the supervisor (hpc.liveness): one that closes without the rank's
bye, on a node whose slurmd does not answer a TCP connect, is a lost node, seen in about a
second. A task srun reports dead of a signal (`task 1: Killed`) is the other death with evidence.
Either way no collective of the step can end: its tasks are SIGKILLed at once (scancel, not
waited for: slurmctld answers it after its message to a lost node timed out; and a pkill step on
the live nodes, which Slurm runs even while it is still ending the step), srun is killed, and
the next step starts without the lost nodes. Hangs have no such evidence: the step has also
failed when a rank that wrote a heartbeat in this step (the watchdog's, every 5 s) writes none
for HEARTBEAT_SILENT_S; srun is then asked to end the step (two SIGINTs). From such a failure
on, the nodes are probed (a one-task step on each; a node is lost once it is several times
slower to answer than the slowest node that did, PROBE_S at most). srun gets the cluster's
KillWait (the ranks blocked in a collective go only at its SIGKILL) plus HUNG_STEP_MARGIN_S to
end the step, or KillWait plus 2 s once a probe found a lost node; then it is killed, and the
next step starts on the nodes that answered. Every restart runs with --overlap, because a hung
step still holds its CPUs in Slurm's books.

Each step's record (launch, first failure, end, exit code, what was decided) is appended to
`<requests dir>/<job id>.steps.jsonl`, where rank 0 reads the cost of an interruption.
Standard library only (and hpc's leaves): it starts before the ranks and must start fast.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpc.env import (
    ALLOCATION_RESTARTS_VARIABLE,
    REQUEST_DIR_VARIABLE,
    STEP_ATTEMPT_VARIABLE,
    STEP_NODES_VARIABLE,
    WARM_GPUS_VARIABLE,
    WARM_RANKS_VARIABLE,
    WARM_VARIABLE,
    checkpoint_memory,
    job_id,
    private_dir,
)
from hpc.liveness import LIVENESS_VARIABLE, Listener, node_answers, unanswering
from hpc.rundir import RunDir
from hpc.slurm import slurmctl
from hpc.slurm.environment import job_node_list, restart_count, slurm_job_id
from hpc.slurm.warmnodes import STEP_NAME as WARM_STEP_NAME
from hpc.slurm.warmnodes import WarmNodes, warm_program

# After a failed task Slurm ends the step's other tasks (SIGTERM, KillWait, SIGKILL); a step still
# running HUNG_STEP_MARGIN_S after that waits on a lost node.
HUNG_STEP_MARGIN_S = 10.0
# The ranks' watchdog threads rewrite their heartbeat every poll (5 s by default): three polls
# missed means the process or its node is gone, not a slow step (HPCTK_HEARTBEAT_SILENT_S overrides).
HEARTBEAT_SILENT_S = 15.0
# A node whose one-task probe step has not ended is taken as lost after PROBE_S at most, and as
# soon as it is PROBE_SLOWER times slower than the slowest node that answered (never before
# PROBE_FLOOR_S): healthy nodes answer within a second or two, a lost one never does.
PROBE_S = 30.0
PROBE_FLOOR_S = 8.0
PROBE_SLOWER = 4.0
# A step that cannot go on (a node lost, a rank dead): srun gets this long to end once its tasks
# were SIGKILLed (it waits for a lost node's, and for the step's end in Slurm's books, KillWait, otherwise).
SRUN_AFTER_KILL_S = 0.5
# The step's scancels still in flight when the job is about to be requeued are waited for (a lost
# node's are answered after MessageTimeout) or killed: Slurm numbers a requeued job's steps from 0
# again, and a late SIGKILL for step N of this start would end step N of the next (seen in CI).
CANCELS_SETTLE_S = 15.0
NO_PROGRESS_LIMIT = 2  # restarts in a row with no new committed checkpoint before giving up
# srun's report of a task that ended badly: "srun: error: node2: tasks 0-1: Killed",
# "srun: error: node1: task 3: Exited with exit code 1". The first names where the failure began.
FAILED_TASKS = re.compile(r"srun: error: (?P<node>[^\s:]+): tasks? [\d,\-]+: (?P<what>.+)")
LOST_NODE = re.compile(r"srun: error: Node failure on (?P<node>[^\s,]+)")


OOM_HINT = " (SIGKILL: out of memory?)"


def failure_text(line: str) -> str:
    """srun's line of a failed task, said as the toolkit says a death: a task Slurm saw killed
    (SIGKILL, nobody's stop) was most often the kernel's out-of-memory killer's doing (Slurm's own
    cgroup says `Out Of Memory` where it watches memory)."""
    text = line.strip().removeprefix("srun: error: ")
    return f"{text}{OOM_HINT}" if text.endswith(": Killed") else text


@dataclass
class StepRecord:
    """One srun step, as appended to `<id>.steps.jsonl` (times: Unix seconds)."""

    start: int  # SLURM_RESTART_COUNT: which start of the job
    attempt: int  # 0, then one more per restart in this allocation
    nodes_excluded: list[str]
    launched: float
    failed: float | None = None  # srun's first report of a failed task or a lost node
    failure: str = ""  # that report
    first_failed_node: str | None = None
    ended: float | None = None
    exit_code: int | None = None
    hung: bool = False  # srun did not end the step by itself: killed after the probes
    decision: str = ""  # "restart" or why not
    lost_nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class StepOutcome:
    """What is known once a step has ended, to decide whether to start the ranks again."""

    exit_code: int
    finished: bool  # rank 0 marked the training complete
    stop_requested: bool  # rank 0 asked the EXIT trap for a requeue (preemption, time limit)
    error: bool  # a rank hit an error that would repeat (hpc.rank.main.abort_job)
    job_running: bool
    restarts: int  # done so far in this start of the job
    max_restarts: int
    steps_without_progress: int  # restarts in a row, this one included, that committed no new checkpoint
    usable_nodes: int
    needed_nodes: int


def why_not_restart(outcome: StepOutcome) -> str | None:
    """None: start the ranks again in this allocation; otherwise the reason not to."""
    if outcome.finished:
        return "the training is complete"
    if outcome.stop_requested:
        return "the ranks stopped and asked for a requeue"
    if outcome.exit_code == 0:
        return "the step ended cleanly"
    if outcome.error:
        return "a rank hit an error that would repeat"
    if not outcome.job_running:
        return "the job is no longer running"
    if outcome.restarts >= outcome.max_restarts:
        return f"all {outcome.max_restarts} restarts in this allocation are spent"
    if outcome.steps_without_progress >= NO_PROGRESS_LIMIT:
        return f"the last {outcome.steps_without_progress} restarts committed no new checkpoint"
    if outcome.usable_nodes < outcome.needed_nodes:
        return f"{outcome.usable_nodes} usable nodes left, the step needs {outcome.needed_nodes} (no spare left)"
    return None


def with_options(srun: Sequence[str], options: Sequence[str]) -> list[str]:
    """`srun` with `options` put right after the word srun (before the program and its arguments)."""
    return [srun[0], *options, *srun[1:]]


def without(env: Mapping[str, str], name: str) -> dict[str, str]:
    return {key: value for key, value in env.items() if key != name}


def probe_deadline(answered_after: Sequence[float]) -> float:
    """Seconds from the probes' launch after which a node that has not answered is taken as lost,
    given how long the nodes that did answer took."""
    if not answered_after:
        return PROBE_S
    return min(PROBE_S, max(PROBE_FLOOR_S, PROBE_SLOWER * max(answered_after)))


def probe_nodes(nodes: Sequence[str]) -> list[str]:
    """The nodes of `nodes` that fail a one-task step, or do not end it by `probe_deadline`; all
    probed at once."""
    began = time.monotonic()
    pending = {node: subprocess.Popen(slurmctl.task_per_node([node], "true"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for node in nodes}
    answered_after: list[float] = []
    lost = []
    while pending:
        elapsed = time.monotonic() - began
        for node, probe in list(pending.items()):
            code = probe.poll()
            if code is not None:
                del pending[node]
                if code == 0:
                    answered_after.append(elapsed)
                else:
                    lost.append(node)
        if pending and elapsed >= probe_deadline(answered_after):
            for node, probe in pending.items():
                probe.kill()
                probe.wait()
                lost.append(node)
            break
        time.sleep(0.05)  # several children, no single exit to wait on
    return sorted(lost, key=list(nodes).index)


def settle(processes: Sequence[subprocess.Popen[bytes]], within_s: float) -> None:
    """Each of `processes` ended: waited for, all together within `within_s`, else killed."""
    deadline = time.monotonic() + within_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kill_ranks(nodes: Sequence[str], run_dir: Path) -> subprocess.Popen[bytes] | None:
    """SIGKILL, on each of `nodes`, the rank processes of the run dir (a Python interpreter running
    `-m hpc.rank.main RUN_DIR`: not srun's client nor a supervisor started by hand, whose command
    lines end the same), through a step of one task per node (--overlap: the ranks' step still
    holds the CPUs in Slurm's books). None when srun cannot be started."""
    try:
        pkill = slurmctl.task_per_node(nodes, "pkill", "-KILL", "-f", "--", rank_pattern(run_dir))
        return subprocess.Popen(pkill, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return None


def rank_pattern(run_dir: Path) -> str:
    """pkill's pattern (a POSIX extended regular expression) for the run dir's rank processes."""
    literal = "".join(f"\\{c}" if c in ".[]()*+?{}|^$\\" else c for c in str(run_dir))
    return rf"^[^ ]*python[^ ]*( -[^ ]+)* -m hpc\.rank\.main {literal}$"


class StepWatch:
    """Runs one srun and reads its stderr (passed on unchanged) for the first failed task."""

    def __init__(
        self, command: list[str], env: Mapping[str, str], record: StepRecord, job_id: str = "local", slurmd: Mapping[str, tuple[str, int]] | None = None
    ) -> None:
        self.record = record
        self.job_id = job_id
        self.silent_after_s = float(env.get("HPCTK_HEARTBEAT_SILENT_S") or HEARTBEAT_SILENT_S)
        self.failed = threading.Event()
        self.lost: list[str] = []  # nodes a rank's closed connection pointed to and whose slurmd does not answer
        self.slurmd = dict(slurmd or {})  # where each node's slurmd listens (slurmctl.slurmd_addresses)
        self.cancels: list[subprocess.Popen[bytes]] = []  # scancels of a lost node's step, answered after MessageTimeout
        self.died = False  # srun's first failed task died of a signal (Killed, Segmentation fault, ...), not an exit code
        self.first = threading.Lock()  # the listener's thread and srun's reader race to say the step's failure first
        self.listener = Listener(self._connection_closed)
        try:
            self.process = subprocess.Popen(command, env={**env, LIVENESS_VARIABLE: self.listener.address}, stderr=subprocess.PIPE, text=True, errors="replace")
        except BaseException:
            self.listener.close()
            raise
        self.reader = threading.Thread(target=self._read_stderr, daemon=True)
        self.reader.start()

    def _connection_closed(self, rank: str, node: str) -> None:
        """A rank's connection closed without a bye (hpc.liveness): its node is lost if its slurmd
        does not answer; otherwise the rank alone ended, and srun says how."""
        if node not in self.lost:
            self._node_lost(node, f"rank {rank}'s connection closed")

    def _node_lost(self, node: str, evidence: str) -> bool:
        """Whether `node`, which `evidence` (a rank's closed connection, srun's line of a task
        killed there) points to, is lost: its slurmd does not answer. The step's failure is then
        the node's loss, whichever evidence came first (a lost node's slurmstepd may report its
        task killed before the rank's connection is seen closed)."""
        address = self.slurmd.get(node)
        if address is None or node_answers(address):
            return False
        with self.first:
            if node not in self.lost:
                self.lost.append(node)
        self._first_failure(f"node {node} lost ({evidence}, its slurmd does not answer)", node)
        return True

    def _first_failure(self, failure: str, node: str, died: bool = False) -> bool:
        """Say the step's failure as its first evidence does (what comes later only adds to what is
        known): False where another evidence came first."""
        with self.first:
            if self.failed.is_set():
                return False
            self.record.failed = time.time()
            self.record.failure = failure
            self.record.first_failed_node = node
            self.died = died
            self.failed.set()
            return True

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            found = None if self.failed.is_set() else FAILED_TASKS.search(line) or LOST_NODE.search(line)
            if found is None:
                continue
            node = found.group("node")
            died = "what" in found.groupdict() and not found.group("what").startswith("Exited with exit code")
            if not (died and self._node_lost(node, f"srun: {line.strip().removeprefix('srun: error: ')}")):
                self._first_failure(failure_text(line), node, died)

    def wait(self, allocation_nodes: Callable[[], list[str]], heartbeats: Callable[[], Path | None]) -> int:
        """srun's exit code. The step has failed when a rank's closed connection points to a lost
        node (hpc.liveness), when srun reports a failed task, or when a rank of this step stops
        rewriting its heartbeat (a hang). A lost node, or a task dead of a signal, ends the step at
        once (no collective of it can end), unless its ranks had begun to end (one of them said
        how its part ended: rank 0 may still be writing the run's end, and gets srun's SIGTERM
        and KillWait). Otherwise the nodes are probed, and a step that has not ended KillWait +
        HUNG_STEP_MARGIN_S later waits on a lost node: srun is killed (exit code -9)."""
        while self.process.poll() is None:
            if not (self.failed.wait(timeout=1.0) or self._silent_rank(heartbeats())):
                continue
            folder = heartbeats()
            run_dir = folder.parent if folder is not None else None
            ending = bool(self.lost or self.died) and run_dir is not None and self._ranks_ending(RunDir(run_dir))
            if self.lost and not ending:
                others = [n for n in allocation_nodes() if n not in self.lost]
                self.lost += unanswering(others, self.slurmd)  # the other nodes lost in the same moment (a rack, a switch), asked at once
                self.record.lost_nodes = list(self.lost)
                self._end_step_now([n for n in others if n not in self.lost], run_dir)
                break
            if self.died and not ending:
                self._end_step_now(allocation_nodes(), run_dir)  # before the probes: their steps must not get its SIGKILL
            probing = ThreadWithResult(lambda: probe_nodes(allocation_nodes()))
            if self._hung(slurmctl.kill_wait_s(), probing):
                self.record.hung = True
                self.process.kill()
            self.record.lost_nodes = sorted({*probing.result(), *self.lost})
            node, failure = self.record.first_failed_node, self.record.failure
            if failure and node in self.record.lost_nodes and node not in self.lost:
                self.record.failure = f"node {node} lost ({failure.removesuffix(OOM_HINT)}, no step starts there)"  # what failed first was the node
            break
        code = self.process.wait()
        self.reader.join(timeout=5)
        self.listener.close()
        return code

    def _ranks_ending(self, run_dir: RunDir) -> bool:
        """Whether a rank of this step has said how its part ended (hpc.rank.outcomes)."""
        try:
            return any(path.stat().st_mtime >= self.record.launched for path in run_dir.outcomes.glob("rank-*.json"))
        except OSError:
            return False

    def _end_step_now(self, live_nodes: list[str], run_dir: Path | None) -> None:
        """No collective of this step can end (a node lost, a rank dead): its tasks get SIGKILL at
        once, not srun's SIGTERM and KillWait (nothing they could save would commit), and srun,
        which waits for a lost node until Slurm declares it DOWN and for the step's end after
        that, is killed SRUN_AFTER_KILL_S later. Slurm signals a step it is already ending (srun
        -K after a task's death) only once that ending is over (KillWait): the ranks on the live
        nodes are also SIGKILLed by a one-task-per-node step of their own, waited for, so the next
        step's ranks never share the nodes' CPUs with the last one's."""
        self.cancels = slurmctl.kill_tasks_now(self.job_id, sparing=WARM_STEP_NAME) if self.job_id != "local" else []
        killing = kill_ranks(live_nodes, run_dir) if run_dir is not None and live_nodes else None
        try:
            self.process.wait(timeout=SRUN_AFTER_KILL_S)
        except subprocess.TimeoutExpired:
            self.record.hung = True
            self.process.kill()
        if killing is not None:
            try:
                killing.wait(timeout=PROBE_FLOOR_S)
            except subprocess.TimeoutExpired:
                killing.kill()
                killing.wait()

    def _silent_rank(self, folder: Path | None) -> bool:
        """A rank that wrote a heartbeat in this step and then none for HEARTBEAT_SILENT_S: its
        process or node is gone. srun is asked to end the step (two SIGINTs: Slurm kills the tasks)."""
        now = time.time()
        for path in folder.glob("rank-*.json") if folder is not None and folder.is_dir() else []:
            try:
                beat = json.loads(path.read_text())
                written, host, rank = float(beat["time"]), str(beat["host"]), int(beat["rank"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being rewritten, or not ours
            if written >= self.record.launched and now - written > self.silent_after_s:
                self._first_failure(f"rank {rank} on {host} silent for {now - written:.0f} s", host)
                for _ in range(2):  # srun: a second Ctrl-C within a second ends the step
                    self.process.send_signal(signal.SIGINT)
                    time.sleep(0.2)
                return True
        return False

    def _hung(self, kill_wait_s: float, probing: ThreadWithResult) -> bool:
        """Whether srun is still running KillWait + HUNG_STEP_MARGIN_S from now, or KillWait + 2 s
        once the probes found a lost node (the tasks on the others are gone by then)."""
        began = time.monotonic()
        while self.process.poll() is None:
            waited = time.monotonic() - began
            if waited >= kill_wait_s + HUNG_STEP_MARGIN_S or (waited >= kill_wait_s + 2 and probing.done() and probing.result()):
                return True
            time.sleep(0.2)  # srun's end has no event to wait on but its exit
        return False


class ThreadWithResult:
    """Run `work` in a thread now; `result()` waits for what it returned."""

    def __init__(self, work: Callable[[], list[str]]) -> None:
        self._result: list[str] = []
        self._thread = threading.Thread(target=lambda: self._result.extend(work()), daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> list[str]:
        self._thread.join()
        return self._result


class Supervisor:
    def __init__(self, srun: list[str], env: Mapping[str, str]) -> None:
        self.srun = srun
        self.env = env
        self.job_id = slurm_job_id(env) or "local"
        self.start = restart_count(env)
        self.requests = Path(env[REQUEST_DIR_VARIABLE]) if env.get(REQUEST_DIR_VARIABLE) else None
        self.max_restarts = int(env.get(ALLOCATION_RESTARTS_VARIABLE) or 0)
        self.needed_nodes = int(env.get(STEP_NODES_VARIABLE) or 0)
        self.cancels: list[subprocess.Popen[bytes]] = []
        self.slurmd: dict[str, tuple[str, int]] = {}

    def marker(self, suffix: str) -> Path | None:
        return self.requests / f"{self.job_id}.{suffix}" if self.requests else None

    def exists(self, suffix: str) -> bool:
        marker = self.marker(suffix)
        return marker is not None and marker.exists()

    def allocation_nodes(self) -> list[str]:
        """The job's nodes as Slurm has them now (a lost node leaves a --no-kill job's list)."""
        node_list = slurmctl.job_fields(self.job_id).get("NodeList") or job_node_list(self.env)
        return slurmctl.hostnames(node_list) if node_list else []

    def nodes_left(self, excluded: tuple[str, ...]) -> list[str]:
        return [node for node in self.allocation_nodes() if node not in excluded]

    def run_dir(self) -> Path | None:
        """The run dir, which rank 0 names in `<id>.run-dir` as it starts."""
        pointer = self.marker("run-dir")
        return Path(pointer.read_text().strip()) if pointer is not None and pointer.is_file() else None

    def heartbeats(self) -> Path | None:
        run_dir = self.run_dir()
        return run_dir / "heartbeats" if run_dir is not None else None

    def newest_checkpoint(self) -> int:
        """The newest committed step of the run (rank 0 names its run dir in `<id>.run-dir`)."""
        from trainers.checkpoint.storage import newest_committed

        run_dir = self.run_dir()
        if run_dir is None:
            return -1
        newest = newest_committed(run_dir / "checkpoints", attempts=3)
        return 0 if newest is None else newest

    def append(self, record: StepRecord) -> None:
        log = self.marker("steps.jsonl")
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            with log.open("a") as f:
                f.write(json.dumps(asdict(record)) + "\n")

    def run(self) -> int:
        warm = self.start_warm_nodes()
        try:
            return self.run_steps(warm)
        finally:
            if warm is not None:
                warm.stop()
            job_dir = checkpoint_memory(job_id(self.env) or self.job_id)
            if private_dir(job_dir.parent) and private_dir(job_dir):  # the checkpoint copies of nodes whose warm process died with them
                shutil.rmtree(job_dir, ignore_errors=True)

    def start_warm_nodes(self) -> WarmNodes | None:
        """Every node's warm process (hpc.rank.warm), spares included, where the job wants them
        and its ranks run this machine's Python (not a container's)."""
        program = warm_program(self.srun)
        if self.job_id == "local" or self.env.get(WARM_RANKS_VARIABLE, "1") != "1" or program is None:
            return None
        gpus = int(self.env.get(WARM_GPUS_VARIABLE) or 0)
        return WarmNodes.adopt(program, self.env, gpus) or WarmNodes(self.allocation_nodes(), program, self.env, gpus)

    def run_steps(self, warm: WarmNodes | None) -> int:
        self.slurmd = slurmctl.slurmd_addresses() if self.job_id != "local" else {}  # once: a lost node's is asked in a hurry
        excluded: list[str] = []
        restarts = without_progress = 0
        repeat_offender: str | None = None
        while True:
            options = [*(["--overlap"] if restarts else []), *([f"--exclude={','.join(excluded)}"] if excluded else [])]
            record = StepRecord(self.start, restarts, list(excluded), time.time())
            checkpoint_before = self.newest_checkpoint()
            # the batch script exported the warm token: the ranks get it only while a warm process can take them
            env = {**without(self.env, WARM_VARIABLE), STEP_ATTEMPT_VARIABLE: str(restarts), **(warm.env() if warm is not None else {})}
            watch = StepWatch(with_options(self.srun, options), env, record, self.job_id, self.slurmd)
            code = watch.wait(functools.partial(self.nodes_left, tuple(excluded)), self.heartbeats)
            record.ended, record.exit_code = time.time(), code
            self.cancels = [cancel for cancel in [*self.cancels, *watch.cancels] if cancel.poll() is None]  # reaped as they end
            without_progress = without_progress + 1 if restarts and self.newest_checkpoint() <= checkpoint_before else 0
            # A node where the first rank died in two steps in a row is failing: leave it out while a spare is left.
            failing = record.first_failed_node if record.first_failed_node == repeat_offender else None
            repeat_offender = record.first_failed_node
            alive = [n for n in self.allocation_nodes() if n not in excluded and n not in record.lost_nodes]
            if failing in alive and len(alive) > self.needed_nodes:
                alive.remove(failing)
                record.lost_nodes.append(failing)
            outcome = StepOutcome(
                exit_code=code,
                finished=self.exists("finished"),
                stop_requested=self.exists(f"restart-{self.start}"),
                error=self.exists(f"error-{self.start}"),
                job_running=slurmctl.job_state(self.job_id) == "RUNNING",
                restarts=restarts,
                max_restarts=self.max_restarts,
                steps_without_progress=without_progress,
                usable_nodes=len(alive),
                needed_nodes=self.needed_nodes or len(alive),
            )
            reason = why_not_restart(outcome)
            record.decision = reason or "restart"
            self.append(record)
            if reason is not None:
                if code != 0 and restarts:
                    say(f"not restarting job {self.job_id} in its allocation: {reason}")
                settle(self.cancels, CANCELS_SETTLE_S)
                return code
            excluded += [n for n in record.lost_nodes if n not in excluded]
            if warm is not None:
                warm.revive(alive)
            restarts += 1
            left_out = f", leaving out {', '.join(excluded)}" if excluded else ""
            say(
                f"the ranks failed ({record.failure or f'srun exit {code}'}): starting them again in this allocation"
                f" from the last committed checkpoint (restart {restarts} of {self.max_restarts}{left_out})"
            )


def say(message: str) -> None:
    print(f"hpc-toolkit: {message}", file=sys.stderr, flush=True)


def supervise_step(srun: list[str]) -> None:
    """What submitit runs in the batch step (hpc.slurm.batch.submit_array): the ranks' srun line
    under the supervisor. It ends the process with the step's exit code (SystemExit, which
    submitit's job runner lets through): the batch script's EXIT trap decides on a requeue by it,
    and the runner does not log "Job completed successfully" after ranks that stopped to requeue."""
    for name in ("SIGTERM", "SIGCONT"):  # submitit's runner ignores them; the batch step ends on SIGTERM as a plain script does
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    sys.stdout.flush()
    raise SystemExit(main(list(srun)))


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hpc.slurm.supervise", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("srun", nargs=argparse.REMAINDER, metavar="srun [SRUN OPTIONS] PROGRAM [ARGS]", help="the ranks' srun line")
    srun = parser.parse_args(argv).srun
    if not srun or Path(srun[0]).name != "srun":
        parser.error("the command to supervise must be an srun line (the batch script's command)")
    # The batch shell's --signal (B:) is not ours: never let a stray user signal end the supervisor.
    for name in ("SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), lambda signum, frame: None)
    code = Supervisor(srun, os.environ).run()
    return code if 0 <= code < 256 else 128 + abs(code) % 128


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
