"""Every call to Slurm's command-line tools (scontrol, squeue, sacct, sinfo), and the parsing of
what they print. Nothing else in the toolkit runs them; submitit runs sbatch itself.

Each call returns what it learned or an empty answer (a tool missing, a job Slurm forgot);
none raises for those, since every caller has a fallback (status shows the run dir's view,
a rank exits with EXIT_RESUMABLE instead of requeueing).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence

log = logging.getLogger(__name__)
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# `scontrol requeue` is tried again while it fails and the job still runs (or Slurm cannot say:
# a busy or restarting slurmctld times out RPCs): REQUEUE_TRIES tries, the wait before try N+1
# N x REQUEUE_BACKOFF_S, no try begun after REQUEUE_DEADLINE_S, each scontrol call given
# SCONTROL_TIMEOUT_S (its own MessageTimeout is 10 s by default). The batch script's EXIT trap
# does the same in bash (hpc.slurm.batch.requeue_function_lines).
REQUEUE_TRIES = 5
REQUEUE_BACKOFF_S = 2
REQUEUE_DEADLINE_S = 45
SCONTROL_TIMEOUT_S = 20
WAITING_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "SUSPENDED", "RESV_DEL_HOLD", "STOPPED"}


def available(tool: str = "scontrol") -> bool:
    return shutil.which(tool) is not None


def _run(args: list[str], timeout_s: float = 60) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); exit code 127 when the tool is missing or hangs."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, check=False, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        return 127, "", str(err)
    return done.returncode, done.stdout, done.stderr


def parse_job_fields(text: str) -> dict[str, str]:
    """One line of `scontrol show job -o` -> {Key: Value} (values hold no spaces in -o mode,
    except the command line, which we do not read)."""
    fields = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def job_fields(job_id: str, timeout_s: float = 60) -> dict[str, str]:
    """`scontrol show job -o JOB` as {Key: Value}; empty when Slurm does not know the job (or
    did not answer within `timeout_s`)."""
    code, out, _ = _run(["scontrol", "show", "job", "-o", job_id], timeout_s)
    return parse_job_fields(out) if code == 0 else {}


def array_task_ids(spec: str) -> list[int]:
    """Slurm's ArrayTaskId field ("0-15%2", "3,5-7", "4") as task numbers."""
    ids: list[int] = []
    for part in spec.split("%")[0].split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            ids.extend(range(int(low), int(high or low) + 1))
    return ids


def job_records(job_ids: Iterable[str]) -> dict[str, dict[str, str]]:
    """`scontrol show job -o` fields for these jobs (array tasks included), keyed by "123" or
    "123_4"; jobs Slurm no longer knows are missing."""
    if not available("scontrol"):
        return {}
    records: dict[str, dict[str, str]] = {}
    for base in sorted({job_id.split("_")[0] for job_id in job_ids}):
        code, out, _ = _run(["scontrol", "show", "job", "-o", base])
        for line in out.splitlines() if code == 0 else []:
            fields = parse_job_fields(line)
            tasks = fields.get("ArrayTaskId", "N/A")
            if tasks in ("N/A", ""):
                records[fields.get("JobId", "")] = fields
            else:  # tasks not started yet share one record: "0-15%2", "3,5-7"; an array cancelled
                # before any task started keeps a record for all (ArrayTaskId 4294967294)
                ids = array_task_ids(tasks) if len(tasks) < 10 or "-" in tasks or "," in tasks else []
                records.update((f"{fields['ArrayJobId']}_{task}", fields) for task in ids)
                if not ids:
                    records.setdefault(f"{fields['ArrayJobId']}_*", fields)
    return records


def record_of(records: dict[str, dict[str, str]], job_id: str) -> dict[str, str]:
    """A job's fields among job_records(): its own, or (an array task not started yet) the
    record its array's unstarted tasks share; {} when Slurm knows neither."""
    return records.get(job_id) or records.get(f"{job_id.split('_')[0]}_*", {})


def job_state(job_id: str) -> str:
    """The job's state from squeue (works without accounting); UNKNOWN once Slurm forgot it."""
    code, out, _ = _run(["squeue", "-h", "-j", job_id, "--states=all", "-o", "%T"])
    states = out.split()
    return states[0] if code == 0 and states else "UNKNOWN"


def accounting_states(job_ids: Sequence[str]) -> dict[str, str]:
    """Final states from sacct, where accounting runs; empty otherwise."""
    if not job_ids or not available("sacct"):
        return {}
    code, out, _ = _run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)])
    states = {}
    for line in out.splitlines() if code == 0 else []:
        job_id, _, state = line.partition("|")
        states[job_id] = state.split()[0] if state else "UNKNOWN"
    return states


def requeue(job_id: str, restarts_before: int = 0, sleep: Callable[[float], None] = time.sleep) -> str | None:
    """`scontrol requeue`, tried again while it fails and the job still runs and allows a requeue
    (REQUEUE_TRIES); the last error text, or None once it went through. A try that timed out may
    still go through once slurmctld reads it: a restart count above `restarts_before` (this
    start's) says so."""
    if not available("scontrol"):
        return "scontrol not found"  # no controller to wait for: trying again would only sleep
    began, error = time.monotonic(), ""
    for attempt in range(1, REQUEUE_TRIES + 1):
        code, _, err = _run(["scontrol", "requeue", job_id], SCONTROL_TIMEOUT_S)
        if code == 0:
            return None
        error = err.strip() or f"exit code {code}"
        log.warning("scontrol requeue %s failed (try %d of %d): %s", job_id, attempt, REQUEUE_TRIES, error)
        fields = job_fields(job_id, SCONTROL_TIMEOUT_S)
        if fields:  # Slurm answers again
            if fields.get("Restarts", "").isdigit() and int(fields["Restarts"]) > restarts_before:
                return None
            if fields.get("JobState") != "RUNNING" or fields.get("Requeue") == "0" or fields.get("BatchFlag") == "0":
                break  # cancelled, ending, or a job Slurm never requeues
        if attempt == REQUEUE_TRIES or time.monotonic() - began >= REQUEUE_DEADLINE_S:
            break
        sleep(attempt * REQUEUE_BACKOFF_S)
    return error


def forbid_requeue(job_id: str) -> bool:
    """Clear the job's Requeue flag (the batch script's EXIT trap then leaves it ended)."""
    return _run(["scontrol", "update", f"jobid={job_id}", "requeue=0"])[0] == 0


def start_now(job_id: str) -> str | None:
    """Start a pending job without its BeginTime hold; returns the error text, or None."""
    code, _, err = _run(["scontrol", "update", f"jobid={job_id}", "starttime=now"])
    return None if code == 0 else err.strip() or f"exit code {code}"


def config_value(name: str, timeout_s: float = 60) -> str | None:
    """The first word of a setting in `scontrol show config` ("KillWait = 30 sec": "30"); None
    when Slurm does not say."""
    code, out, _ = _run(["scontrol", "show", "config"], timeout_s)
    for line in out.splitlines() if code == 0 else []:
        key, _, value = line.partition("=")
        if key.strip() == name and value.split():
            return value.split()[0]
    return None


def kill_wait_s(default: float = 30.0) -> float:
    """The cluster's KillWait: how long a step's tasks get between SIGTERM and SIGKILL."""
    value = config_value("KillWait")
    return float(value) if value is not None and value.isdigit() else default


def slurmd_addresses() -> dict[str, tuple[str, int]]:
    """Where each node's slurmd listens (`scontrol show node`: NodeAddr, Port; an old Slurm that
    shows no Port: the cluster's SlurmdPort), by node name; one call for the whole cluster."""
    code, out, _ = _run(["scontrol", "show", "node", "-o"], 10)
    nodes = [parse_job_fields(line) for line in out.splitlines()] if code == 0 else []
    default = config_value("SlurmdPort", 10) if any("Port" not in fields for fields in nodes) else None
    found = {}
    for fields in nodes:
        port = fields.get("Port") or default
        if fields.get("NodeName") and fields.get("NodeAddr") and port and port.isdigit():
            found[fields["NodeName"]] = (fields["NodeAddr"], int(port))
    return found


def hostnames(node_list: str) -> list[str]:
    """`scontrol show hostnames`: a Slurm hostlist ("node[1-3]") as names."""
    code, out, _ = _run(["scontrol", "show", "hostnames", node_list])
    return out.split() if code == 0 else []


def partitions() -> list[str]:
    """The cluster's partitions, as sinfo lists them (the default marked `*`); [] when sinfo fails."""
    code, out, _ = _run(["sinfo", "-h", "-o", "%P"], timeout_s=20)
    return list(dict.fromkeys(line.strip() for line in out.splitlines() if line.strip())) if code == 0 else []


def node_states(partition: str, node: str | None = None) -> dict[str, str]:
    """{node: state} of a partition's nodes (one node's with `node`), from sinfo."""
    code, out, _ = _run(["sinfo", "-h", "-N", "-p", partition, *(["-n", node] if node else []), "-o", "%N %T"])
    pairs = (line.split() for line in out.splitlines() if code == 0)
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2}


def submit_wrapped(command: str, *sbatch_args: str) -> tuple[str | None, str]:
    """`sbatch --parsable [ARGS] --wrap COMMAND` (a job that is not a run of ours, e.g. a
    preemptor in the benchmarks): (its job id or None, sbatch's error text)."""
    code, out, err = _run(["sbatch", "--parsable", *sbatch_args, "--wrap", command])
    return (out.strip().split(";")[0] or None, "") if code == 0 else (None, err.strip() or f"exit code {code}")


def max_array_size() -> int | None:
    """The cluster's MaxArraySize (`scontrol show config`): array task ids stay below it; None:
    not known (no scontrol, or no such line)."""
    code, out, _ = _run(["scontrol", "show", "config"]) if available("scontrol") else (1, "", "")
    found = re.search(r"^MaxArraySize\s*=\s*(\d+)", out, re.MULTILINE) if code == 0 else None
    return int(found.group(1)) if found else None


def srun_has_option(option: str) -> bool | None:
    """Whether this cluster's srun lists `option` in its help (a SPANK plugin's, such as pyxis's
    --container-image, shows there); None: no srun here to ask."""
    if not available("srun"):
        return None
    code, out, err = _run(["srun", "--help"])
    return option in out + err


def task_steps(job_id: str, sparing: str | None = None) -> list[str]:
    """The job's steps that run its tasks (`JOB.0`, `JOB.1`, ...: srun's), not its batch shell
    or extern step, nor those named `sparing`; empty when none runs or Slurm did not answer."""
    code, out, _ = _run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"])
    rows = [line.split(maxsplit=1) for line in out.splitlines() if line.strip()] if code == 0 else []
    return [row[0] for row in rows if row[0].rpartition(".")[2].isdigit() and (sparing is None or row[1:] != [sparing])]


def kill_tasks(job_id: str) -> str | None:
    """SIGKILL to the tasks of the job's steps, at once, as a rank's death or a lost node ends
    them: the job and its batch shell go on (a SIGKILL to the job itself cancels it, and Slurm
    sends SIGTERM first). The error text, or None; none running is an error.

    One scancel for all the steps (it signals them together): one after another, the ranks
    killed with the first step were restarted by the supervisor as forks of a warm process
    that the next scancel then killed, a second restart no lost node makes."""
    steps = task_steps(job_id)
    if not steps:
        return f"no step of job {job_id} runs tasks now"
    code, _, err = _run(["scancel", "--signal=KILL", *steps])
    if code == 0 or not set(steps) & set(task_steps(job_id)):
        return None  # a step that ended meanwhile (killed with the warm step its ranks were forks of) is no failure
    return err.strip() or f"exit code {code}"


def kill_tasks_now(job_id: str, sparing: str | None = None) -> list[subprocess.Popen[bytes]]:
    """`kill_tasks` without waiting for scancel, sparing the steps named `sparing`: with a node
    lost, slurmctld signals the live nodes' tasks at once but answers scancel only once its
    message to the lost node timed out (MessageTimeout, 10 s by default). The scancels still
    running, for the caller to reap."""
    started = []
    for step in task_steps(job_id, sparing):
        try:
            started.append(subprocess.Popen(["scancel", "--signal=KILL", step], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except OSError:
            pass
    return started


def cancel(job_id: str, signal: str | None = None) -> str | None:
    """`scancel` the job, or with `signal` only signal its processes (as preemption's
    send_user_signal does); returns the error text, or None."""
    code, _, err = _run(["scancel", *([f"--signal={signal}"] if signal else []), job_id])
    return None if code == 0 else err.strip() or f"exit code {code}"


def task_per_node(nodes: Sequence[str], *command: str) -> list[str]:
    """An srun line running `command` once on each of `nodes`, beside the ranks' step (--overlap:
    a hung step still holds its CPUs in Slurm's books)."""
    count = len(nodes)
    return ["srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "--overlap", "--quiet", *command]
