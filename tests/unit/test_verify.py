"""The resume verifier's pure parts (hpc/verify): what it compares, what it says, what it runs.
Its runs on real ranks: tests/mpi/test_verify.py."""

from __future__ import annotations

import random

import pytest
import torch

from hpc.config.schema import VerifyConfig
from hpc.errors import UserError
from hpc.verify.compare import compare_states, first_divergence, flatten, hint, kind_of, same_leaf
from hpc.verify.resume import child_overrides, stop_steps, streams
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.checkpoint.state import rank_buffers, restore_rank_buffers


def test_flatten_names_every_leaf_and_leaves_out_wall_clock_figures_and_the_config_text():
    state = {"model": {"w": torch.ones(2)}, "progress": {"step": 3, "epoch_seconds": 1.5, "train_seconds": 9.0}, "config": "run_dir: /a", "rng": [1, (2, 3)]}
    assert set(flatten(state)) == {"model.w", "progress.step", "rng[0]", "rng[1][0]", "rng[1][1]"}


def test_leaves_are_equal_bit_for_bit_only():
    assert same_leaf(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
    assert not same_leaf(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal as numbers, not as bits
    assert not same_leaf(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert not same_leaf(torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 2.0]]))
    assert same_leaf(torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([1.5], dtype=torch.bfloat16))
    assert not same_leaf(torch.tensor([1.0]), 1.0)
    assert same_leaf(float("nan"), float("nan")) and not same_leaf(1, 1.0) and same_leaf("a", "a")


def test_states_differ_where_a_leaf_differs_or_only_one_has_it():
    ref = {"a": torch.zeros(3), "b": 1, "c": 2.0}
    got = {"a": torch.tensor([0.0, 0.0, 1e-30]), "b": 1, "d": 2.0}
    diff = compare_states(ref, got)
    assert diff.differing == ["a", "c", "d"] and diff.compared == 4 and diff.tensors == 1
    assert compare_states(ref, dict(ref)).differing == []


def test_the_first_divergence_is_the_first_step_whose_losses_differ_or_that_one_run_lacks():
    ref = {1: (("loss", 0.5),), 2: (("loss", 0.25),), 3: (("loss", 0.125),)}
    assert first_divergence(ref, dict(ref)) is None
    assert first_divergence(ref, {**ref, 2: (("loss", 0.25000001),)}) == 2
    assert first_divergence(ref, {1: ref[1], 2: ref[2]}) == 3
    assert first_divergence(ref, {**ref, 1: (("d_loss", 0.5),)}) == 1


def test_a_differing_leaf_is_named_by_kind():
    buffers = ["1.running_mean", "ema.shadow"]
    assert kind_of("shared:model.1.running_mean", buffers) == "a buffer"
    assert kind_of("rank 1:buffers.1.running_var", []) == "a buffer"
    assert kind_of("shared:state.model.ema.shadow", buffers) == "a buffer"
    assert kind_of("rank 0:rng.torch", buffers) == "an RNG stream"
    assert kind_of("shared:optimizer.state.0.exp_avg", buffers) == "optimizer state"
    assert kind_of("shared:scaler.scale", buffers) == "the grad scaler"
    assert kind_of("shared:model.0.weight", buffers) == "a parameter or registered state"
    assert kind_of("shared:state.progress.position", buffers) == kind_of("shared:state.schedule.last_epoch", buffers) == "a counter or value"
    assert kind_of("shared:state.scaler.scale", buffers) == "the grad scaler"


def test_the_hint_names_a_batch_drawn_ahead_when_the_first_step_after_a_resume_differs():
    assert "drawn ahead" in hint(31, [12, 30], ["a parameter or registered state"]) and "resume from step 30" in hint(31, [12, 30], [])
    later = hint(40, [12, 30], ["a buffer"])
    assert later.startswith("10 steps after the resume from step 30") and "BatchNorm" in later and "drawn ahead" not in later
    assert "BatchNorm" in hint(None, [30], ["a buffer", "a buffer"])


def test_the_verifiers_runs_get_the_jobs_overrides_without_its_own_with_its_length_and_saves():
    given = ["model=cnn", "verify=resume", "verify.stops=3", "+verify.seed=1", "trainer.max_steps=500", "checkpoint.every_steps=0"]
    assert child_overrides(given, 120, 20, builtin_loop=True) == ["model=cnn", "trainer.max_steps=120", "checkpoint.every_steps=20"]
    assert child_overrides(given, None, 20, builtin_loop=True) == ["model=cnn", "trainer.max_steps=500", "checkpoint.every_steps=20"]
    assert child_overrides(["script=train.py", "verify=resume"], 120, 10, builtin_loop=False) == ["script=train.py", "checkpoint.every_steps=10"]


def test_stops_land_at_distinct_random_steps_in_the_first_two_thirds():
    for seed in range(50):
        steps = stop_steps(120, 2, random.Random(seed))
        assert len(steps) == 2 and steps[0] < steps[1] <= 80 and steps[0] >= 1
    assert stop_steps(120, 2, random.Random(7)) == stop_steps(120, 2, random.Random(7))  # verify.seed repeats them
    assert stop_steps(3, 5, random.Random(0)) == [1, 2]


def test_unseeded_streams_are_named_by_rank():
    names = ["rank 0:rng.python[1][3]", "rank 0:rng.python[1][4]", "rank 0:rng.numpy[1]", "rank 1:rng.numpy[1]"]
    assert streams(names) == "rank 0: python, numpy; rank 1: numpy"


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"mode": "resumes"}, "verify.mode='resumes' is not one of resume"),
        ({"steps": 3}, "verify.steps=3 must be >= 4"),
        ({"stops": -1}, "verify.stops=-1 must be >= 0"),
        ({"every_steps": 0}, "verify.every_steps=0 must be >= 1"),
    ],
)
def test_verify_settings_are_checked_in_one_line(setting, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        VerifyConfig(**setting).check()
    VerifyConfig(mode="resume", steps=None).check()


def test_every_ranks_buffers_come_back_as_it_saved_them():
    """Without SyncBatchNorm each rank's BatchNorm statistics are its own: shared.ckpt's are rank
    0's, so each rank keeps its own in its file, and a resume restores them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 3))  # this rank's statistics
    saved = rank_buffers(model)
    other = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    restore_rank_buffers(other, saved, 7)
    assert all(torch.equal(a, b) for a, b in zip(other.buffers(), model.buffers(), strict=True))
    model(torch.randn(8, 3))  # the saved copies are copies
    assert not torch.equal(saved["1.running_mean"], model[1].running_mean)
    restore_rank_buffers(other, None, 7)  # none saved (another world size): left as loaded
    with pytest.raises(CheckpointError, match="buffer '1.num_batches_tracked' is missing from this model"):
        restore_rank_buffers(torch.nn.Sequential(torch.nn.Linear(3, 4)), saved, 7)


POLITE = """
import signal, sys, time
signal.signal(signal.SIGINT, lambda *_: sys.exit(3))
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
print("ready", flush=True)
time.sleep(30)
"""


def test_a_ctrl_c_stops_every_run_the_verifier_started(tmp_path):
    """Its runs have sessions of their own (a terminal's Ctrl-C reaches the verifier only): it
    passes the stop on, and kills what does not end within the grace."""
    import signal
    import sys
    import time

    from hpc.verify.runs import Launch
    from tests.support.runs import signal_sets

    # The polite run handles SIGINT itself (exit 3): a `sleep` inherits whatever the test worker
    # does with SIGINT, and three CI runs of this session's saw it outlive its SIGINT (-9)
    polite = Launch([sys.executable, "-c", POLITE], tmp_path / "a.log")
    stubborn = Launch(["bash", "-c", "trap '' INT; sleep 30 & wait"], tmp_path / "b.log")
    log = tmp_path / "a.log"
    while "ready" not in log.read_text() or signal.SIGINT not in signal_sets(stubborn.proc.pid, "SigIgn"):
        time.sleep(0.01)  # its handler (it says so) and bash's trap are set
    began = time.monotonic()
    Launch.stop_all(grace_s=1.0)
    assert polite.proc.returncode == 3 and stubborn.proc.poll() is not None and time.monotonic() - began < 10
    assert not Launch.live


@pytest.mark.parametrize(
    ("arguments", "code", "said"),
    [
        (["verify=resume", "model=cnn", "dry_run=true"], 0, "trainer.max_steps=120 checkpoint.every_steps=20` uninterrupted, then stopped 2 times"),
        (
            ["verify=resume", "cluster=simulated", "dry_run=true"],
            0,
            "` as jobs of simulated (each requeue waits for the scheduler's hold and queue) uninterrupted, then stopped 2 times",
        ),
        (["-m", "verify=resume", "optim.lr=0.1,0.2"], 2, "error: verify=resume checks one job: leave out -m"),
        (["verify=resume", "checkpoint.enabled=false"], 2, "error: verify=resume compares the job's checkpoints"),
    ],
)
def test_what_the_verifier_would_run_and_what_it_refuses_in_one_line(tmp_path, arguments, code, said):
    import subprocess
    import sys

    from tests.support.runs import ROOT

    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), *arguments, f"run_root={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == code and said in done.stdout + done.stderr, done.stdout + done.stderr
    assert not list(tmp_path.rglob("*.yaml")) and len((done.stdout + done.stderr).strip().splitlines()) == 1  # nothing made, one line
