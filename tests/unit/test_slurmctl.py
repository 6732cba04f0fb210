"""hpc.slurm.slurmctl against stand-in Slurm tools on PATH: what each call runs, how it parses the
answer, and that a missing or failing tool gives an empty answer instead of an exception."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpc.slurm import slurmctl

SCONTROL_JOB = (
    "JobId=41 ArrayJobId=40 ArrayTaskId=1 JobName=train JobState=RUNNING Restarts=2 Requeue=1 "
    "BatchHost=node1 NodeList=node[1-2] EndTime=2026-11-24T01:00:00\n"
    "JobId=42 ArrayJobId=40 ArrayTaskId=2-3%2 JobName=train JobState=PENDING Restarts=0\n"
)


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A bin/ with fake scontrol, squeue, sacct, sinfo, scancel, each logging its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    answers = {
        "scontrol": f'case "$1 $2" in "show job") printf %b {SCONTROL_JOB!r};; "show hostnames") printf "node1\\nnode2\\n";; esac',
        "squeue": 'echo "RUNNING"',
        "sacct": 'printf "40_1|COMPLETED\\n40_2|CANCELLED by 0\\n"',
        "sinfo": 'printf "node1 idle\\nnode2 down*\\n"',
        "scancel": 'echo "scancel: error: Invalid job id $1" >&2; exit 1',
    }
    for tool, body in answers.items():
        script = bin_dir / tool
        script.write_text(f'#!/bin/bash\necho "{tool} $*" >> {calls}\n{body}\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin")
    return calls


def test_job_records_key_array_tasks_by_their_ids(tools: Path):
    records = slurmctl.job_records(["40_1", "40_3"])
    assert set(records) == {"40_1", "40_2", "40_3"}  # pending tasks share one record ("2-3%2")
    assert records["40_1"]["Restarts"] == "2" and records["40_3"]["JobState"] == "PENDING"
    assert tools.read_text().splitlines() == ["scontrol show job -o 40"]  # one call per array


def test_state_accounting_hostnames_and_node_states_parse_what_the_tools_print(tools: Path):
    assert slurmctl.job_state("41") == "RUNNING"
    assert slurmctl.accounting_states(["40_1", "40_2"]) == {"40_1": "COMPLETED", "40_2": "CANCELLED"}
    assert slurmctl.hostnames("node[1-2]") == ["node1", "node2"]
    assert slurmctl.node_states("debug") == {"node1": "idle", "node2": "down*"}
    assert slurmctl.job_fields("41")["BatchHost"] == "node1"


def test_a_failing_tool_returns_its_error_text_and_the_exact_command_ran(tools: Path):
    assert slurmctl.cancel("99", signal="USR1") == "scancel: error: Invalid job id --signal=USR1"
    assert tools.read_text().splitlines() == ["scancel --signal=USR1 99"]


def test_killing_a_jobs_tasks_signals_every_step_in_one_scancel_and_spares_the_batch_shell(tools: Path):
    # one after another, the ranks killed with the first step were restarted as forks of a warm
    # process the next scancel then killed: a second restart that no lost node makes
    squeue = tools.parent / "bin" / "squeue"
    squeue.write_text(f'#!/bin/bash\necho "squeue $*" >> {tools}\nprintf "7.batch batch\\n7.extern extern\\n7.0 hpc-warm\\n7.1 hpc-warm\\n7.2 train\\n"\n')
    assert slurmctl.kill_tasks("7") == "scancel: error: Invalid job id --signal=KILL"
    assert "scancel --signal=KILL 7.0 7.1 7.2" in tools.read_text().splitlines()
    assert sum(line.startswith("scancel") for line in tools.read_text().splitlines()) == 1
    # a step that ended between squeue and scancel (its ranks were forks of a warm step killed with it): no failure
    squeue.write_text(f'#!/bin/bash\necho "squeue $*" >> {tools}\n[[ -e {tools}.listed ]] || {{ touch {tools}.listed; echo "7.2 train"; }}\n')
    assert slurmctl.kill_tasks("7") is None
    squeue.write_text("#!/bin/bash\n")
    assert slurmctl.kill_tasks("7") == "no step of job 7 runs tasks now"


def test_without_slurm_every_answer_is_empty(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no tool at all
    assert not slurmctl.available("scontrol")
    assert slurmctl.job_fields("1") == {} and slurmctl.job_records(["1"]) == {} and slurmctl.accounting_states(["1"]) == {}
    assert slurmctl.job_state("1") == "UNKNOWN" and slurmctl.hostnames("n1") == []
    assert slurmctl.requeue("1") is not None and slurmctl.forbid_requeue("1") is False


def test_waiting_for_a_job_outlasts_a_failing_squeue_and_streams_rank0s_console(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from hpc.slurm.batch import UNKNOWN_POLLS, Follower, wait_for_job

    bin_dir, count = tmp_path / "bin", tmp_path / "count"
    bin_dir.mkdir()
    # squeue fails for its first three answers (as when slurmctld is busy), then the job runs, then ends
    script = bin_dir / "squeue"
    script.write_text(
        f"#!/bin/bash\nn=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}\n"
        "if (( n <= 3 )); then exit 1; elif (( n <= 5 )); then echo RUNNING; else echo COMPLETED; fi\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin")
    # rank 0's stdout (submitit's runner writes there too: left out) and stderr, the last line unended
    out, err = tmp_path / "7_0_log.out", tmp_path / "7_0_log.err"
    out.write_text("submitit INFO (2026-12-02 05:52:27,907) - Starting with JobEnvironment(job_id=7)\nstep 1\nstep 2\niter 3: loss 2.7")
    err.write_text("a warning\n")
    lines: list[str] = []
    errors: list[str] = []
    assert 3 < UNKNOWN_POLLS
    assert wait_for_job("7", [Follower(out, lines.append), Follower(err, errors.append)], poll_s=0) == "COMPLETED"
    assert lines == ["step 1", "step 2", "iter 3: loss 2.7"] and errors == ["a warning"] and count.read_text().strip() == "6"
    count.write_text(str(-100))  # from now on: UNKNOWN for good (Slurm forgot the job)
    script.write_text("#!/bin/bash\nexit 0\n")
    assert wait_for_job("7", [Follower(out, lines.append)], poll_s=0) == "UNKNOWN"


def test_an_empty_restart_count_is_no_restart():
    from hpc.slurm.environment import restart_count

    assert restart_count({"SLURM_RESTART_COUNT": ""}) == 0 and restart_count({}) == 0 and restart_count({"SLURM_RESTART_COUNT": "3"}) == 3
