"""The batch script's step supervisor (hpc.slurm.supervise): when it starts the ranks again in
the allocation and when it leaves the job to the EXIT trap. The decision is a pure function; the
loop runs here against stand-in srun and scontrol scripts (the real Slurm runs it in
tests/e2e/test_allocation_restart_slurm.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hpc.slurm import supervise
from hpc.slurm.supervise import (
    NO_PROGRESS_LIMIT,
    PROBE_FLOOR_S,
    PROBE_S,
    PROBE_SLOWER,
    StepOutcome,
    probe_deadline,
    probe_nodes,
    why_not_restart,
    with_options,
)

FAILED = StepOutcome(
    exit_code=137,
    finished=False,
    stop_requested=False,
    error=False,
    job_running=True,
    restarts=0,
    max_restarts=3,
    steps_without_progress=0,
    usable_nodes=2,
    needed_nodes=2,
)


def test_a_failed_step_is_started_again_while_restarts_and_nodes_are_left():
    assert why_not_restart(FAILED) is None
    assert why_not_restart(replace(FAILED, restarts=2, usable_nodes=3)) is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (dict(finished=True), "the training is complete"),
        (dict(stop_requested=True), "asked for a requeue"),
        (dict(exit_code=0), "ended cleanly"),
        (dict(error=True), "an error that would repeat"),
        (dict(job_running=False), "no longer running"),
        (dict(restarts=3), "all 3 restarts"),
        (dict(steps_without_progress=NO_PROGRESS_LIMIT), "committed no new checkpoint"),
        (dict(usable_nodes=1), "1 usable nodes left, the step needs 2"),
    ],
)
def test_no_restart_when(change, reason):
    assert reason in (why_not_restart(replace(FAILED, **change)) or "")


def test_options_go_right_after_the_word_srun():
    assert with_options(["srun", "--mpi=pmix", "python", "-m", "x"], ["--overlap"]) == ["srun", "--overlap", "--mpi=pmix", "python", "-m", "x"]


FAKE_SRUN = """#!/bin/bash
# Stand-in srun: step N exits with the N-th code of $FAKE_CODES, and a failing step says so as srun does.
if [[ $1 == --nodes=1 ]]; then exit 0; fi  # a node probe: every node answers
echo "$*" >> "$FAKE_DIR/calls"
n=$(wc -l < "$FAKE_DIR/calls")
code=$(echo $FAKE_CODES | cut -d' ' -f$n)
if [[ -n $FAKE_COMMIT ]]; then mkdir -p "$FAKE_DIR/run/checkpoints/step-00000000$n" && touch "$FAKE_DIR/run/checkpoints/step-00000000$n/COMMITTED"; fi
if [[ -n $FAKE_ERROR && $n == 1 ]]; then echo "rank 1: ValueError" > "$HPCTK_REQUEUE_DIR/7.error-0"; fi
echo "attempt $HPCTK_STEP_ATTEMPT" >> "$FAKE_DIR/attempts"
if (( code != 0 )); then echo "srun: error: node2: task 1: Exited with exit code $code" >&2; fi
exit $code
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
"show job") echo "JobId=7 JobState=RUNNING Requeue=1 NodeList=node[1-2]" ;;
"show hostnames") echo node1; echo node2 ;;
"show config") echo "KillWait                = 1 sec" ;;
esac
"""


def run_supervisor(
    tmp_path: Path, codes: str, scontrol: str = FAKE_SCONTROL, srun: str | None = None, **extra: str
) -> tuple[int, list[dict[str, object]], list[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", srun or FAKE_SRUN), ("scontrol", scontrol), ("squeue", "#!/bin/bash\necho RUNNING\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    requests = tmp_path / "requests"
    requests.mkdir()
    (requests / "7.run-dir").write_text(str(tmp_path / "run"))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path),
        "FAKE_CODES": codes,
        "SLURM_JOB_ID": "7",
        "HPCTK_REQUEUE_DIR": str(requests),
        "HPCTK_STEP_NODES": "2",
        "HPCTK_ALLOCATION_RESTARTS": "3",
        **extra,
    }
    # SIGINT at its default in the supervisor, hence in the fake srun: bash cannot trap a signal it
    # started with ignored (a test run started in the background ignores it), and the fake srun's
    # trap is how these tests see the supervisor's two interrupts.
    done = subprocess.run(
        [sys.executable, "-m", "hpc.slurm.supervise", "srun", "--mpi=pmix", "ranks"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    steps = [json.loads(line) for line in (requests / "7.steps.jsonl").read_text().splitlines()]
    return done.returncode, steps, (tmp_path / "calls").read_text().splitlines(), done.stderr


def test_a_failed_step_restarts_with_overlap_until_it_succeeds(tmp_path):
    code, steps, calls, err = run_supervisor(tmp_path, "137 1 0", FAKE_COMMIT="1")
    assert code == 0, err
    assert [s["attempt"] for s in steps] == [0, 1, 2] and [s["decision"] for s in steps] == ["restart", "restart", "the step ended cleanly"]
    assert calls == ["--mpi=pmix ranks", "--overlap --mpi=pmix ranks", "--overlap --mpi=pmix ranks"]
    assert (tmp_path / "attempts").read_text().split("\n")[:3] == ["attempt 0", "attempt 1", "attempt 2"]
    assert "restart 2 of 3" in err and steps[0]["failure"] == "node2: task 1: Exited with exit code 137"


def test_a_node_where_the_first_rank_died_twice_is_left_out_while_a_spare_is_left(tmp_path):
    scontrol = FAKE_SCONTROL.replace("NodeList=node[1-2]", "NodeList=node[1-3]").replace("echo node2 ;;", "echo node2; echo node3 ;;")
    code, steps, calls, err = run_supervisor(tmp_path, "1 1 0", scontrol, FAKE_COMMIT="1")
    assert code == 0, err
    assert calls == ["--mpi=pmix ranks", "--overlap --mpi=pmix ranks", "--overlap --exclude=node2 --mpi=pmix ranks"]
    assert steps[1]["lost_nodes"] == ["node2"] and "leaving out node2" in err


def test_no_node_is_left_out_without_a_spare(tmp_path):
    code, steps, calls, err = run_supervisor(tmp_path, "1 1 0", FAKE_COMMIT="1")
    assert code == 0 and not any("--exclude" in call for call in calls), calls


def test_restarts_end_when_they_are_spent_and_srun_s_code_goes_to_the_trap(tmp_path):
    code, steps, calls, err = run_supervisor(tmp_path, "9 9 9 9 9", FAKE_COMMIT="1")
    assert code == 9 and len(calls) == 4
    assert steps[-1]["decision"] == "all 3 restarts in this allocation are spent" and "not restarting job 7" in err


def test_restarts_that_commit_nothing_end_early(tmp_path):
    code, steps, calls, err = run_supervisor(tmp_path, "9 9 9 9 9")
    assert code == 9 and len(calls) == 1 + NO_PROGRESS_LIMIT
    assert "committed no new checkpoint" in steps[-1]["decision"]


def test_an_error_that_would_repeat_is_not_restarted(tmp_path):
    code, steps, calls, err = run_supervisor(tmp_path, "1 0", FAKE_ERROR="1")
    assert code == 1 and len(calls) == 1 and steps[0]["decision"] == "a rank hit an error that would repeat"


SILENT_SRUN = """#!/bin/bash
# Stand-in srun whose rank 1 wrote one heartbeat and went silent (its node lost): it runs until
# interrupted twice (srun then ends the step), as srun waits for a node Slurm has not declared DOWN yet.
if [[ $1 == --nodes=1 ]]; then [[ $4 == --nodelist=node2 ]] && exit 1; exit 0; fi  # node2 does not answer
echo "$*" >> "$FAKE_DIR/calls"
if [[ $(wc -l < "$FAKE_DIR/calls") == 1 ]]; then
    # the trap first: the heartbeat below starts the supervisor's clock (a loaded machine once
    # delivered its interrupt before this script had reached the trap)
    trap 'echo interrupted >> "$FAKE_DIR/interrupts"; [[ $(wc -l < "$FAKE_DIR/interrupts") == 2 ]] && exit 130' INT
    mkdir -p "$FAKE_DIR/run/heartbeats"
    now=$(date +%s.%N)
    echo "{\\"rank\\": 1, \\"step\\": 3, \\"host\\": \\"node2\\", \\"pid\\": 1, \\"time\\": $now}" > "$FAKE_DIR/run/heartbeats/rank-00001.json"
    while true; do sleep 0.1; done
fi
exit 0
"""


def test_a_rank_whose_heartbeat_went_silent_ends_the_step_and_its_unanswering_node_is_left_out(tmp_path):
    scontrol = FAKE_SCONTROL.replace("NodeList=node[1-2]", "NodeList=node[1-3]").replace("echo node2 ;;", "echo node2; echo node3 ;;")
    code, steps, calls, err = run_supervisor(tmp_path, "0", scontrol, SILENT_SRUN, HPCTK_HEARTBEAT_SILENT_S="2")
    assert code == 0, err
    assert steps[0]["failure"].startswith("node node2 lost (rank 1 on node2 silent for") and steps[0]["lost_nodes"] == ["node2"]
    assert calls[1] == "--overlap --exclude=node2 --mpi=pmix ranks"
    assert (tmp_path / "interrupts").read_text().count("interrupted") == 2  # srun was asked to end the step


def test_an_unanswered_probe_waits_for_several_times_the_slowest_answer_within_bounds():
    assert probe_deadline([]) == PROBE_S  # nothing to compare with: the full wait
    assert probe_deadline([0.3, 0.5]) == PROBE_FLOOR_S  # fast answers: never sooner than the floor
    assert probe_deadline([0.5, 2.0 * PROBE_FLOOR_S / PROBE_SLOWER]) == 2.0 * PROBE_FLOOR_S  # a slow cluster: waits longer
    assert probe_deadline([PROBE_S]) == PROBE_S  # never beyond the bound


def test_a_node_that_never_answers_its_probe_is_lost_once_the_others_answered(tmp_path, monkeypatch):
    """node2's probe hangs (a lost node), node3's fails, node1 answers: only node1 is usable, and the
    hanging probe is given up on from node1's answer, not after PROBE_S (set to 10 minutes here)."""
    srun = tmp_path / "srun"
    srun.write_text(
        '#!/bin/bash\ncase "$4" in\n--nodelist=node2) exec sleep 600 ;;\n--nodelist=node3) exit 1 ;;\nesac\necho "$4" >> "$(dirname "$0")/answered"\n'
    )
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(supervise, "PROBE_S", 600.0)
    monkeypatch.setattr(supervise, "PROBE_FLOOR_S", 0.5)
    found: list[list[str]] = []
    probing = threading.Thread(target=lambda: found.append(probe_nodes(["node1", "node2", "node3"])), daemon=True)
    probing.start()
    probing.join(timeout=60)
    assert found == [["node2", "node3"]], "the probe of the lost node was waited on for PROBE_S"
    assert (tmp_path / "answered").read_text().split() == ["--nodelist=node1"]
    assert not subprocess.run(["pgrep", "-f", "sleep 600"], capture_output=True).stdout, "the hanging probe was left running"


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ("srun: error: node2: task 1: Killed", "node2: task 1: Killed (SIGKILL: out of memory?)"),
        ("srun: error: node2: task 1: Out Of Memory", "node2: task 1: Out Of Memory"),  # Slurm's cgroup said so itself
        ("srun: error: node2: task 1: Exited with exit code 3", "node2: task 1: Exited with exit code 3"),
    ],
)
def test_a_task_slurm_saw_killed_is_said_as_a_likely_out_of_memory_death(line, said):
    assert supervise.failure_text(line) == said


def test_a_run_dirs_pkill_pattern_matches_its_ranks_command_line_alone(tmp_path):
    import subprocess as sp

    from hpc.slurm.supervise import rank_pattern

    run_dir = Path("/runs/2026-12-02/08-52-37.811_train (a+b)[1]{2}^$|x\\y")
    rank = f"/usr/bin/python3.11 -u -m hpc.rank.main {run_dir}"
    lines = [
        rank,
        f"python -m hpc.rank.main {run_dir}",
        f"{rank}/other",  # another run dir
        "python -m hpc.rank.main /runs/2026-12-02",
        f"srun --unbuffered --mpi=pmix /usr/bin/python -u -m hpc.rank.main {run_dir}",  # the ranks' srun client
        f"python -m hpc.slurm.supervise srun --mpi=pmix python -u -m hpc.rank.main {run_dir}",  # a supervisor started by hand
    ]
    found = sp.run(["grep", "-E", "--", rank_pattern(run_dir)], input="\n".join(lines) + "\n", capture_output=True, text=True)
    assert found.stdout.splitlines() == lines[:2]


def test_the_step_s_scancels_are_settled_before_the_job_is_requeued():
    """A requeued job's steps are numbered from 0 again: a scancel of this start's step left
    running would kill the next start's step of the same number (seen in CI). Settled: the
    quick ones waited for, one still running at the bound killed."""
    quick = subprocess.Popen(["true"])
    stuck = subprocess.Popen(["sleep", "60"])
    started = time.monotonic()
    supervise.settle([quick, stuck], within_s=0.5)
    assert quick.returncode == 0 and stuck.returncode == -signal.SIGKILL and time.monotonic() - started < 5
