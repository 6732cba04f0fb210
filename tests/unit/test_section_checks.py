"""Each config section checks its own settings (issue 47: one place for each rule): the trainer's
sections and the comm section refuse without the login node's code (no hpc import, the message is
the one line validate shows), and the cluster's sections refuse alone, before any cross check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from collectives.backends import check_comm
from collectives.config import CommConfig
from hpc.config.schema import ClusterConfig, ResourcesConfig, SweepConfig
from hpc.errors import UserError
from trainers.config import CheckpointConfig, ConfigError, DataConfig, ModelConfig, OptimConfig, TrainerConfig

SECTIONS = [ModelConfig(), TrainerConfig(), DataConfig(), OptimConfig(), CheckpointConfig(), ClusterConfig(), ResourcesConfig(), SweepConfig()]


def test_every_section_s_defaults_pass_its_own_check():
    refused = []
    for check in [*(section.check for section in SECTIONS), lambda: check_comm(CommConfig())]:
        try:
            check()
        except (ValueError, UserError) as err:
            refused.append(str(err))
    assert refused == []


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (TrainerConfig(epochs=0), "trainer.epochs=0 must be >= 1"),
        (TrainerConfig(threads_per_rank=0), "trainer.threads_per_rank=0 must be >= 1"),
        (TrainerConfig(accumulation_steps=0), "trainer.accumulation_steps=0 must be >= 1"),
        (TrainerConfig(straggler_ratio=1.0), r"trainer.straggler_ratio=1.0 must be > 1"),
        (TrainerConfig(precision="fp8"), "trainer.precision='fp8' is not one of fp32, bf16, fp16"),
        (TrainerConfig(eval_every=-1), r"trainer.eval_every=-1 must be >= 0 \(0: evaluate at epoch ends only\)"),
        (DataConfig(eval_batch_size=0), "data.eval_batch_size=0 must be >= 1"),
        (DataConfig(crop_padding=4), "data.crop_padding=4 pads for a random crop: set data.crop too"),
        (OptimConfig(schedule="step"), "optim.schedule='step' is not one of cosine, constant"),
        (OptimConfig(min_lr=1.0), r"optim.min_lr=1.0 must be between 0 and optim.lr=0.05"),
        (TrainerConfig(seed=-1), r"trainer.seed=-1 must be >= 0"),
        (TrainerConfig(max_steps=0), r"trainer.max_steps=0 must be >= 1, or null for no limit"),
        (OptimConfig(lr=float("inf")), r"optim.lr=inf must be a finite number > 0"),
        (OptimConfig(lr=float("nan")), r"optim.lr=nan must be a finite number > 0"),  # not the floor's message
        (OptimConfig(momentum=-1.0), r"optim.momentum=-1.0 must be a finite number >= 0"),
        (OptimConfig(weight_decay=float("nan")), r"optim.weight_decay=nan must be a finite number >= 0"),
        (ModelConfig(dropout=1.0), r"model.dropout=1.0 must be in \[0, 1\)"),
        (ModelConfig(dropout=-0.1), r"model.dropout=-0.1 must be in \[0, 1\)"),
        (ModelConfig(hidden_sizes=[64, 0]), r"model.hidden_sizes=\[64, 0\]: every width must be >= 1"),
        (ModelConfig(channels=[-5]), r"model.channels=\[-5\]: every width must be >= 1"),
        (CheckpointConfig(keep=1), "checkpoint.keep=1: keep at least 2"),
        (CheckpointConfig(best="loss"), "checkpoint.best='loss' must name a validation figure"),
        (CheckpointConfig(best="val_loss", enabled=False), "checkpoint.best=val_loss keeps a checkpoint, but checkpoint.enabled=false"),
    ],
)
def test_the_trainer_s_sections_refuse_their_own_settings_in_one_line(section, message):
    with pytest.raises(ConfigError, match=message) as refused:
        section.check()
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("comm", "message"),
    [
        (CommConfig(backend="ucx"), "comm.backend='ucx' is not one of auto, mpi, gloo, nccl, horovod"),
        (CommConfig(algorithm="tree"), "comm.algorithm='tree' is not one of auto, ring, rhd, hierarchical, mpi"),
        (CommConfig(sharding="zero3"), "comm.sharding='zero3' is not one of none, optimizer, gradients, full"),
        (CommConfig(topk_ratio=0.0), r"comm.topk_ratio=0.0 must be in \(0, 1\]"),
        (CommConfig(ranks_per_node=0), "comm.ranks_per_node=0 must be >= 1"),
    ],
)
def test_the_comm_section_refuses_its_own_settings(comm, message):
    with pytest.raises(ValueError, match=message):
        check_comm(comm)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (ClusterConfig(launcher="pbs"), "cluster.launcher='pbs' is not one of"),
        (ClusterConfig(signal="HUP"), "cluster.signal='HUP': use USR1, USR2, TERM or INT"),
        (ClusterConfig(topology_conf="/nonexistent/topology.conf"), "cluster.topology_conf=/nonexistent/topology.conf: No such file"),
        (ResourcesConfig(cpus_per_task=0), "resources.cpus_per_task=0 must be >= 1"),
        (ResourcesConfig(gpus_per_task=-1), "resources.gpus_per_task=-1 must be >= 0"),
        (SweepConfig(max_parallel=0), r"sweep.max_parallel=0 must be >= 1 \(or null: no limit\)"),
    ],
)
def test_the_cluster_s_sections_refuse_their_own_settings(section, message):
    with pytest.raises(UserError, match=message):
        section.check()


CONF = Path(__file__).resolve().parents[2] / "hpc" / "conf"
# Each trainer section and the file of its default choice (hpc/conf/config.yaml's defaults list)
DEFAULT_FILES = {
    TrainerConfig: "trainer/default.yaml",
    CheckpointConfig: "checkpoint/default.yaml",
    DataConfig: "data/digits.yaml",
    OptimConfig: "optim/sgd.yaml",
    ModelConfig: "model/mlp.yaml",
}


@pytest.mark.parametrize("section", list(DEFAULT_FILES), ids=lambda section: section.__name__)
def test_a_section_s_defaults_are_the_ones_its_default_file_shows_every_field_named(section):
    # What --cfg job and --help show is the file; what a script or a test that builds the
    # section gets is the dataclass: the same values, and no setting missing from the file.
    shown = yaml.safe_load((CONF / DEFAULT_FILES[section]).read_text())
    defaults = {field.name: getattr(section(), field.name) for field in dataclasses.fields(section)}
    assert {name: shown.get(name, "missing from the file") for name in defaults} == defaults


def test_an_optimizer_the_section_does_not_name_is_refused():
    with pytest.raises(ConfigError, match="optim.name='lamb' is not one of sgd, adamw"):
        OptimConfig(name="lamb").check()
