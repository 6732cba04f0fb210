"""The cluster-side settings preemption-safe requeue relies on, checked on the test cluster."""

import subprocess

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def slurm_config() -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    pairs = (line.split("=", 1) for line in out.splitlines() if "=" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def test_requeue_and_preemption_signalling_are_enabled():
    config = slurm_config()
    assert config["JobRequeue"] == "1"  # jobs may be requeued (our sbatch also says --requeue)
    assert "preempt_send_user_signal" in config["SlurmctldParameters"]  # USR1 reaches the ranks on preemption
    assert config["PreemptMode"].startswith("REQUEUE") and config["PreemptType"] == "preempt/partition_prio"


def test_the_preemptible_partition_gives_ranks_time_to_save():
    out = subprocess.run(["scontrol", "show", "partition", "debug"], capture_output=True, text=True, check=True).stdout
    grace = int(out.split("GraceTime=")[1].split()[0])
    assert grace >= 10  # seconds between USR1 and SIGTERM: enough to finish a step and save
