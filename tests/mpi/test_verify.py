"""The resume verifier on real ranks, and the matrix of exactness it is the harness of: each cell
is `launch.py verify=resume ...` (2 local ranks: run uninterrupted, stopped by a real signal at
random steps, killed with SIGKILL after a periodic save, resumed each time from command.txt,
then every step's loss, every validation figure and every leaf of the final checkpoint compared
bit for bit). Features are combined in cells, so that one cell's few starts cover several:

- BatchNorm (model=cnn: each rank's own statistics) on our engine (mpi) with ZeRO-2, and on
  gloo with bf16 autocast, gradient accumulation, clipping, warm-up + cosine, converted shards
  read by loader workers, and augmentation; the LM task with dropout under ZeRO-1 (and that it
  learns: its uninterrupted run is the one the LM test read);
- the run handle: a BatchNorm model on our engine (no DDP broadcasting the statistics), and the
  nanoGPT loop shape that numbers its batches; the same drawing its next batch ahead from torch's
  global generator FAILs, naming the first step after the resume.
- FSDP2 (comm.sharding=full on gloo) with BatchNorm and dropout; Horovod with the fp16
  GradScaler (its scale in the compared state) and dropout; examples/gan_ema (an EMA generator);
  examples/lightning through hpc.lightning; examples/hf_trainer through hpc.hf.
SyncBatchNorm is not a cell: torch runs it on CUDA only."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest

from tests.conftest import require
from tests.support.runs import ROOT, digits_shards, fixtures_env

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

HANDLE = ROOT / "tests" / "fixtures" / "scripts" / "handle" / "train.py"
PREFETCH = ROOT / "tests" / "fixtures" / "scripts" / "prefetch" / "train.py"


def verify(tmp_path, *overrides: str, script_args: list[str] | None = None) -> tuple[int, str]:
    """`launch.py verify=resume OVERRIDES` (-- SCRIPT_ARGS): its exit code and its verdict line."""
    command = [sys.executable, str(ROOT / "launch.py"), "verify=resume", *overrides, f"run_root={tmp_path / 'runs'}"]
    if script_args is not None:
        command += ["--", *script_args]
    done = subprocess.run(command, cwd=tmp_path, env=fixtures_env(), capture_output=True, text=True, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("verify: "), done.stdout[-3000:] + done.stderr[-3000:]
    return done.returncode, lines[-1]


def landed(line: str) -> tuple[list[int], int | None]:
    """The steps the stops landed at and the save the kill came after, from a PASS line."""
    stops = [int(s) for s in re.findall(r"stopped at step (\d+)", line)]
    killed = re.search(r"killed \(SIGKILL\) after the save at step (\d+)", line)
    return stops, int(killed.group(1)) if killed else None


CELLS = {
    "cnn-batchnorm-mpi-zero2": ["model=cnn", "comm=mpi", "comm.sharding=gradients"],
    "cnn-gloo-bf16-accumulation-clip-warmup-shards-workers-augmented": [
        "model=cnn",
        "comm=gloo",
        "trainer.precision=bf16",
        "trainer.accumulation_steps=2",
        "trainer.clip_grad_norm=0.5",
        "optim.warmup_steps=10",
        "data.workers=2",
        "data.crop=8",
        "data.crop_padding=1",
        "data.flip=true",
        "verify.steps=80",
        "verify.stops=1",
    ],
    "lm-dropout-zero1": ["task=lm", "comm.sharding=optimizer", "verify.steps=40", "verify.stops=1", "checkpoint.every_minutes=null"],
    "cnn-fsdp2-gloo-dropout": ["model=cnn", "model.dropout=0.2", "comm=gloo", "comm.sharding=full", "verify.stops=1"],
    "mlp-horovod-fp16-scaler-dropout": ["model=mlp", "model.dropout=0.2", "comm=horovod", "trainer.precision=fp16", "verify.stops=1"],
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_the_built_in_loop_resumes_exactly_in_every_tensor(tmp_path, cell):
    if "horovod" in cell:
        require(importlib.util.find_spec("horovod") is not None, "Horovod (scripts/build-horovod.sh)")
    shards = [f"data.path={digits_shards(tmp_path)}"] if "shards" in cell else []  # written by the converter, several per split
    code, line = verify(tmp_path, *CELLS[cell], *shards)
    assert code == 0 and line.startswith("verify: PASS: "), line
    stops, killed = landed(line)
    assert stops and killed is not None and killed > stops[-1], line  # every interruption landed, the kill after the stops
    if cell.startswith("lm"):  # the LM task learns: its uninterrupted run, read
        learns(next(tmp_path.glob("runs/verify/*/*/reference")))


def learns(run_dir) -> None:
    """task=lm on two ranks from the embedded corpus: its loss falls, AdamW and the corpus pinned."""
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 40 and steps[0]["loss"] > 5.0  # about log(256) = 5.5 at the start
    assert sum(s["loss"] for s in steps[-5:]) / 5 < 0.6 * steps[0]["loss"]  # clearly falling
    config = (run_dir / "config.yaml").read_text()
    assert "name: adamw" in config and "tokens: /" in config  # task=lm brings AdamW; the corpus file is pinned
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["val_metrics"]["perplexity"] == pytest.approx(math.exp(result["val_metrics"]["loss"]))


def test_a_gan_with_an_ema_generator_resumes_exactly(tmp_path):
    """examples/gan_ema: two models, two optimizers and an AveragedModel stepped in turn."""
    script = ROOT / "examples" / "gan_ema" / "train.py"
    code, line = verify(tmp_path, f"script={script}", "resources.tasks_per_node=2", "verify.stops=1", script_args=["--steps", "200"])
    assert code == 0 and line.startswith("verify: PASS: "), line
    assert landed(line)[1] is not None


def test_a_lightning_script_through_hpc_lightning_resumes_exactly_mid_epoch(tmp_path):
    """examples/lightning (hpc.lightning's Trainer and DataLoader): BatchNorm, dropout, a step
    schedule, DDP over gloo, stopped mid-epoch and resumed in every tensor, Lightning's loops and
    the loader's position included. A validation after every batch: the stop and the saves land
    on validation points, where the vote waits for the validation (a save before it resumes with
    that validation skipped: Lightning's restart). The stop is a SIGTERM (Slurm's requeue and
    time limit send it), which Lightning's own handler would turn into an exit before the save."""
    script = ROOT / "examples" / "lightning" / "train.py"
    overrides = [f"script={script}", "resources.tasks_per_node=2", "verify.stops=1", "cluster.signal=TERM"]
    code, line = verify(tmp_path, *overrides, script_args=["--max-steps", "30", "--val-every", "1"])
    assert code == 0 and line.startswith("verify: PASS: "), line
    reference = next(tmp_path.glob("runs/verify/*/*/reference"))
    result = json.loads((reference / "result.json").read_text())
    assert result["steps"] == 30 and set(result["val_metrics"]) == {"acc", "loss"}, result  # as hpc.status and sweep.objective read them
    logged = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "train_loss" in r] == [10, 20, 30], logged  # training_step's self.log, every log_every_n_steps
    assert "pytorch_lightning, hpc.lightning imported there" in (reference / "logs" / "rank-00001.log").read_text()  # once, before the fork


def test_a_hugging_face_trainer_through_hpc_hf_resumes_exactly_across_epochs(tmp_path):
    """examples/hf_trainer (hpc.hf's Trainer): a GPT-2 with dropout, a warm-up and linear decay,
    DDP over gloo, 10 steps an epoch and an evaluation after each: the saves every 10 steps land on
    epoch ends (the vote waits for the epoch's evaluation, which draws from torch's generator),
    the two stops mid-epoch (Hugging Face's batch skipping, its RNG restored where it restores it)."""
    script = ROOT / "examples" / "hf_trainer" / "train.py"
    script_args = ["--max-steps", "40", "--eval-every", "0", "--train-size", "320"]
    code, line = verify(tmp_path, f"script={script}", "resources.tasks_per_node=2", script_args=script_args)
    assert code == 0 and line.startswith("verify: PASS: "), line
    reference = next(tmp_path.glob("runs/verify/*/*/reference"))
    result = json.loads((reference / "result.json").read_text())
    assert result["steps"] == 40 and set(result["val_metrics"]) == {"acc", "loss"}, result


def test_a_run_handle_script_with_batchnorm_on_our_engine_resumes_exactly(tmp_path):
    # 20 ms a step: the kill after the save at step 50 has 0.2 s to land before the run's end (a
    # loaded machine once let the 10 bare steps finish first: no kill, nothing to check it by)
    script_args = ["--sync", "ours", "--batchnorm", "--steps", "60", "--step-seconds", "0.02"]
    code, line = verify(tmp_path, f"script={HANDLE}", "resources.tasks_per_node=2", "verify.stops=1", script_args=script_args)
    assert code == 0 and line.startswith("verify: PASS: "), line
    assert landed(line)[1] is not None and "not compared" in line  # the script seeds neither Python's nor numpy's stream: said


def test_a_loop_drawing_its_next_batch_ahead_from_the_global_generator_fails_at_the_step_after_the_resume(tmp_path):
    """nanoGPT's get_batch: the batch drawn ahead during the stopped step is drawn again, from
    another place in torch's stream, after the resume. The same loop with numbered batches (the
    handle's rule) resumes exactly: tests/mpi/test_prefetch_resume.py."""
    common = [f"script={PREFETCH}", "resources.tasks_per_node=2", "verify.stops=1", "verify.kill=false", "verify.seed=3"]
    code, line = verify(tmp_path, *common, script_args=["--iters", "24", "--draw", "global"])
    assert code == 1, line
    failed = r"verify: FAIL at step (\d+): loss [-0-9.e]+ against loss [-0-9.e]+ uninterrupted; "
    match = re.match(failed + r".*the first step after the resume from step (\d+)", line)
    assert match and int(match.group(1)) == int(match.group(2)) + 1 and "drawn ahead" in line, line
