"""End-to-end through launch.py against the real (simulated multi-node) Slurm cluster."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from benchmarks.simcluster import parse_job_id
from hpc.slurm.slurmctl import TERMINAL_STATES, job_state
from tests.conftest import wait_until_done
from tests.support.runs import run_dirs, run_launch
from trainers.reporting.metrics import read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]

TWO_BY_TWO = ("cluster=simulated", "resources.nodes=2", "resources.tasks_per_node=2")


def test_four_ranks_on_two_nodes_train_and_leave_a_complete_run_dir(tmp_path):
    result = run_launch(*TWO_BY_TWO, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    job_id = parse_job_id(result.stdout)
    assert job_state(job_id) not in TERMINAL_STATES  # launch.py returned at submission
    (run_dir,) = run_dirs(tmp_path)
    assert f"run directory: {run_dir}" in result.stdout

    assert wait_until_done(job_id) == "COMPLETED"
    summary = json.loads((run_dir / "result.json").read_text())
    assert (summary["world_size"], summary["num_nodes"]) == (4, 2)
    assert summary["val_metrics"]["accuracy"] >= 0.95
    assert json.loads((run_dir / "job.json").read_text())["job_id"] == job_id
    assert "resources:\n  nodes: 2\n  tasks_per_node: 2" in (run_dir / "config.yaml").read_text()
    hydra_record = (run_dir / ".hydra" / "hydra.yaml").read_text()  # as Hydra's own run writes it
    assert "  mode: RUN\n" in hydra_record and "- hydra.mode=RUN" in hydra_record and f"output_dir: {run_dir}\n" in hydra_record
    assert (run_dir / ".hydra" / "overrides.yaml").read_text().splitlines()[:3] == [
        "- cluster=simulated",
        "- resources.nodes=2",
        "- resources.tasks_per_node=2",
    ]
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 20

    hosts = {}
    for rank in range(4):
        log = (run_dir / "logs" / f"rank-{rank:05d}.log").read_text()
        hosts[rank] = re.search(rf"\[rank {rank}/4 (\S+)\]", log).group(1)
        assert "launcher slurm" in log and "epoch 20/20" in log
        assert "a fork of this node's warm process (hpc.rank.warm)" in log  # cluster.warm_ranks: one interpreter per node
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # 2 ranks on each of 2 nodes
    assert list((run_dir / "slurm" / job_id).glob(f"{job_id}_*_log.out"))

    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and re.search(r"^#   srun .*--mpi=pmix .*-u -m hpc\.rank\.main ", script, re.M)  # shown
    assert re.search(r"^\S+ -u -m submitit\.core\._submit ", script, re.M)  # submitit's job runner: the step supervisor
    dry = run_launch("dry_run=true", *TWO_BY_TWO, cwd=tmp_path)
    printed = dry.stdout.split("# sbatch script\n", 1)[1]
    dry_dir = re.search(r"--output=(/\S+)/slurm/%j", printed).group(1)
    assert printed.strip() == script.replace(str(run_dir), dry_dir).strip()  # the dry run is exact


def test_wait_streams_rank0s_console_until_the_job_ends(tmp_path):
    """wait=true shows what a local run shows: the toolkit's lines and the script's own output
    (stdout on stdout, stderr on stderr), not submitit's runner's lines."""
    script = tmp_path / "train.py"
    script.write_text("import sys\n\nfor i in range(3):\n    print(f'iter {i}: loss 2.7', flush=True)\nprint('a warning of the script', file=sys.stderr)\n")
    result = run_launch(f"script={script}", "cluster=simulated", "resources.tasks_per_node=2", "wait=true", "cluster.warm_ranks=false", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 local_rank 0" in result.stdout and "warm process" not in result.stdout  # each rank its own interpreter
    assert [line for line in result.stdout.splitlines() if line.startswith("iter ")] == [f"iter {i}: loss 2.7" for i in range(3)]  # rank 0's
    assert "a warning of the script" in result.stderr and "submitit INFO" not in result.stdout
    assert re.search(r"^\S+ \S+ rank 0 local_rank 0 ", result.stdout, re.M) and "ended: COMPLETED" in result.stdout


def test_sbatch_refusal_is_one_line_and_submits_nothing(tmp_path):
    result = run_launch("cluster=simulated", "cluster.partition=nosuchpartition", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: sbatch refused the job") and "partition" in lines[0].lower()
    assert lines[0].endswith("(cluster.partition; this cluster's partitions: debug*, high)")  # what to choose from (the sim's: scripts/slurm-sim.sh)
    assert run_dirs(tmp_path) == []


def test_a_clean_stop_says_what_happened_and_srun_reports_no_killed_tasks(tmp_path):
    """After `python -m hpc.stop RUN_DIR` (`scancel --signal=USR1 JOB`) the ranks checkpoint and
    exit; the batch script requeues the job once srun has returned. No task is reported
    Terminated, no rank logs submitit's "Job completed successfully", and rank 0 says where it
    stopped and what follows."""
    from benchmarks.simcluster import poll, restarts
    from tests.support.runs import logged_steps, stopped_pattern, submit_job

    job_id, run_dir = submit_job(*TWO_BY_TWO, "trainer.epochs=50", "checkpoint.every_minutes=null", cwd=tmp_path)
    poll(lambda: logged_steps(run_dir) >= 3, "step 3", timeout_s=300)  # the queue may be busy
    stop = subprocess.run([sys.executable, "-m", "hpc.stop", str(run_dir)], capture_output=True, text=True, timeout=60)
    sent = f"sent SIGUSR1 to every rank of job {job_id} (scancel --signal=USR1 {job_id}): they stop at the same step and save"
    assert stop.returncode == 0 and stop.stdout.startswith(sent), stop.stdout + stop.stderr
    # Requeued, and back in the queue: the stopped incarnation (srun included) has ended.
    poll(lambda: restarts(job_id) >= 1 and job_state(job_id) == "PENDING", f"job {job_id} to be requeued")
    subprocess.run(["scancel", job_id], check=True, capture_output=True)  # the rerun is not this test's business

    steps = json.loads((run_dir / "result.json").read_text())["steps"]
    rank0 = (run_dir / "logs" / "rank-00000.log").read_text()
    assert re.search(
        stopped_pattern("SIGUSR1", steps) + rf"; external signal: requeueing job {job_id} once every rank has exited \(the batch script does it\)",
        rank0,
    ), rank0[-600:]
    task_logs = {path.name: path.read_text() for path in (run_dir / "slurm" / job_id).glob(f"{job_id}_*_log.*")}
    assert len([name for name in task_logs if name.endswith(".out")]) == 4
    # A rank's rare segfault in Open MPI's start-up (docs/reliability.md: not the toolkit's, not
    # fixed) restarts the ranks in the allocation first, its step's tasks killed: what the stop's
    # step said follows the step supervisor's line of that restart.
    restarted = r"\(node\d+: task \d+: Segmentation fault\): starting them again in this allocation"
    stop_step = {name: re.split(restarted, text)[-1] for name, text in task_logs.items()}
    said = [f"{name}:\n{text[-3000:]}" for name, text in stop_step.items() if "Job completed successfully" in text or "Terminated" in text]
    assert not said, "\n".join(said)
    assert re.search(
        "hpc-toolkit: the ranks " + stopped_pattern("SIGUSR1", steps) + rf" and have exited: requeueing job {job_id}",
        task_logs[f"{job_id}_0_log.err"],
    ), task_logs[f"{job_id}_0_log.err"][-600:]
