"""A script that keeps the toolkit's guarantees through the run handle (hpc.run), started by
launch.py, by torchrun and by mpirun: a real signal stops every rank at the same step with a
committed checkpoint, and the resumed run's per-step losses and final weights are those of an
uninterrupted run, bit for bit; ranks that disagree end in one line, never a hang."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.mpirun import mpirun_command
from hpc.rank.lifecycle import EXIT_RESUMABLE
from tests.conftest import IN_CI
from tests.support.runs import ROOT, ranks_environment, resume_command, run_dirs
from trainers.checkpoint.export import export
from trainers.checkpoint.export import load as load_safetensors

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "handle" / "train.py"


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def by_hand(launcher: list[str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*launcher, str(SCRIPT), *args], cwd=cwd, env=ranks_environment(), capture_output=True, text=True, timeout=300)


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
MPIRUN = mpirun_command(2, [sys.executable])


@pytest.mark.parametrize("sync", ["fsdp"])  # DDP's: tests/mpi/test_prefetch_resume.py (the same checks, two stops)
def test_launch_py_stops_at_a_signal_and_resumes_as_torchrun_trains_uninterrupted(tmp_path, sync, s3):
    """fsdp: the script shards its model with fully_shard (FSDP2); the handle saves each rank's
    rows of the parameters and of AdamW's state in its own file and rebuilds them on resume. The
    checkpoints go to an object store (checkpoint.uri: the S3 server of scripts/s3-sim.sh), and
    the export reads them back from there."""
    work = tmp_path / "work"
    work.mkdir()
    command = [sys.executable, str(ROOT / "launch.py"), f"script={SCRIPT}", "resources.tasks_per_node=2", f"checkpoint.uri={s3}", f"run_root={work / 'runs'}"]
    stopped = subprocess.run(
        [*command, "--", "--sync", sync, "--steps", "30", "--signal-at", "9", "--out", str(tmp_path / "ours.json")],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stopped.returncode == EXIT_RESUMABLE, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert "stopped by SIGUSR1 at step 10, checkpoint committed; not a Slurm job" in stopped.stdout  # step 9's vote, read after step 10
    (run_dir,) = run_dirs(work)
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["steps"], result["handle"]) == ("stopped", 10, True)
    assert not (tmp_path / "ours.json").exists()  # finish() ended the script: nothing after the loop ran

    again, env = resume_command(run_dir)
    resumed = subprocess.run(again, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["resumed_from"], result["steps"]) == ("completed", 10, 30)
    assert set(result["val_metrics"]) == {"loss"}  # what sweep.objective=val_loss reads

    reference = by_hand(TORCHRUN, "--sync", sync, "--steps", "30", "--run-dir", str(tmp_path / "ref"), "--out", str(tmp_path / "ref.json"), cwd=work)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert losses(run_dir) == losses(tmp_path / "ref")
    ours, theirs = (json.loads((tmp_path / name).read_text()) for name in ("ours.json", "ref.json"))
    assert ours["weights"] == theirs["weights"] and ours["best"] == theirs["best"]
    # The model out of the toolkit (for fsdp: every rank's rows consolidated): the final weights
    assert (run_dir / "checkpoints" / "STORE").read_text().startswith(s3) and not list((run_dir / "checkpoints").glob("step-*"))
    written = export(run_dir, tmp_path / "model.safetensors")
    tensors, _ = load_safetensors(tmp_path / "model.safetensors")
    assert written["step"] == 30 and sorted(t.flatten().tolist() for t in tensors.values()) == sorted(ours["weights"])  # the file orders by name


# One uninterrupted run on our engine is every sync's reference: with two ranks, every average
# is the same (a + b) / 2, and a sharded optimizer's step is elementwise, so their losses and
# weights must equal it bit for bit (a reference per sync cost two more launches). Our engine
# unsharded is stopped and resumed the same way under srun, against this same mpirun reference,
# in tests/e2e/test_user_script_slurm.py (two launches less here).
SYNCS = {"horovod": (), "ours-zero2": ("--sharding", "gradients")}


def test_ranks_started_by_mpirun_sync_gradients_on_our_engine_or_horovod_and_resume_bit_exactly(tmp_path):
    """ours-zero2: the optimizer state and the gradients sharded over the ranks (ZeRO-2), each
    rank saving its own part of the state."""
    reference = by_hand(MPIRUN, "--sync", "ours", "--steps", "24", "--run-dir", "ref", "--out", "ref.json", cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert len(losses(tmp_path / "ref")) == 24
    theirs = json.loads((tmp_path / "ref.json").read_text())
    voters = {"horovod": "HorovodCollectives", "ours-zero2": "MpiCollectives"}
    for sync, extra in SYNCS.items():
        if sync == "horovod" and not IN_CI and importlib.util.find_spec("horovod") is None:
            continue  # under CI scripts/install.sh --cluster builds it: it must run
        args = ["--sync", sync.removesuffix("-zero2"), "--steps", "24", *extra, "--run-dir", sync, "--out", f"{sync}.json"]
        stopped = by_hand(MPIRUN, *args, "--signal-at", "7", cwd=tmp_path)
        assert stopped.returncode == EXIT_RESUMABLE, (sync, stopped.stderr[-2000:])
        assert "stopped by SIGUSR1 at step 8, checkpoint committed; not a Slurm job" in stopped.stderr, sync
        resumed = by_hand(MPIRUN, *args, cwd=tmp_path)
        assert resumed.returncode == 0, (sync, resumed.stderr[-2000:])
        assert "resumed from checkpoint step 8" in resumed.stderr, sync
        assert losses(tmp_path / sync) == losses(tmp_path / "ref"), sync
        ours = json.loads((tmp_path / f"{sync}.json").read_text())
        assert ours["weights"] == theirs["weights"] and ours["resumed_from"] == 8, sync
        assert ours["voted_by"] == voters[sync]  # the handle votes through the script's own sync


def test_ranks_that_disagree_end_in_one_line(tmp_path):
    # Through launch.py, the handle's refusal is one line on every rank, no traceback (issue 46:
    # the test ran it under torchrun, where Python prints the exception's traceback, and took that).
    work = tmp_path / "work"
    work.mkdir()
    command = [sys.executable, str(ROOT / "launch.py"), f"script={SCRIPT}", "resources.tasks_per_node=2", "trainer.watchdog_s=3", f"run_root={work / 'runs'}"]
    differ = subprocess.run([*command, "--", "--steps", "3", "--extra-state-rank", "1"], cwd=work, capture_output=True, text=True, timeout=300)
    assert differ.returncode not in (0, EXIT_RESUMABLE)
    (run_dir,) = run_dirs(work)
    refusal = "the ranks register different run state: rank 1 registers state 'second', which rank 0 does not"
    for log in (run_dir / "logs").glob("rank-*.log"):
        text = log.read_text()
        assert "Traceback" not in text and f"error: {refusal}" in text, text[-2000:]
    assert json.loads((run_dir / "result.json").read_text())["status"] == "failed"
    shutil.rmtree(work / "runs")

    # one rank leaves the loop alone: the watchdog ends the job naming it, instead of a hang
    left = subprocess.run([*command, "--", "--steps", "1000", "--leave-rank", "1", "--leave-at", "5"], cwd=work, capture_output=True, text=True, timeout=300)
    assert left.returncode not in (0, EXIT_RESUMABLE)
    (run_dir,) = run_dirs(work)
    logs = "".join(path.read_text() for path in sorted((run_dir / "logs").glob("rank-*.log")))
    assert "watchdog: no step finished for" in logs and "behind: rank 1 on" in logs
    assert "left the loop (the run handle's finish()) after step 5" in logs
