"""The optional parts of a task and of the optim config, trained by fit() in-process: parameter
groups, an optimizer and a scheduler named by `_target_`, activation checkpointing. Each keeps
the guarantees (a stopped run resumes bit-exactly) and bad use is one line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.rundirs import newest_shared_state
from tests.support.fit_in_process import Regression, config, counting_blocks, steps_of, stopped_step, train
from trainers.config import OptimConfig
from trainers.context import FitConfig
from trainers.task import TaskError


class Grouped(Regression):
    """A two-layer regression whose biases are frozen by an lr-0 group: the hook's groups are
    what the optimizer steps."""

    def __init__(self, groups: str = "frozen-bias") -> None:
        super().__init__()
        self.groups = groups

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        if self.groups == "missing":
            return [{"params": weights}]
        if self.groups == "twice":
            return [{"params": weights}, {"params": [*biases, weights[0]]}]
        if self.groups == "foreign":
            return [{"params": [*weights, *biases, nn.Parameter(torch.zeros(1))]}]
        return [{"params": weights}, {"params": biases, "lr": 0.0}]


def with_optim(cfg: FitConfig, **changes: Any) -> FitConfig:
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, **changes))


def test_parameter_groups_from_the_task_are_what_the_optimizer_steps(tmp_path):
    task = Grouped()
    start = {n: p.detach().clone() for n, p in (torch.manual_seed(0), task.build_model())[1].named_parameters()}
    train(tmp_path, task, config(max_steps=10, every_steps=10))
    model = newest_shared_state(tmp_path)["model"]
    assert all(torch.equal(model[n], start[n]) for n in start if n.endswith("bias"))  # lr 0
    assert not any(torch.equal(model[n], start[n]) for n in start if n.endswith("weight"))
    assert [group["lr"] for group in newest_shared_state(tmp_path)["optimizer"]["param_groups"]][1] == 0.0


@pytest.mark.parametrize(
    "groups, message",
    [
        ("missing", r"param_groups leaves out 2 trainable parameters \('0.bias', ...\); put them in a group, or set requires_grad=False"),
        ("twice", r"param_groups: parameter '0.weight' is in more than one group"),
        ("foreign", r"param_groups: a group holds a tensor that is not a parameter of the model"),
    ],
)
def test_parameter_groups_that_miss_or_repeat_a_parameter_are_one_line(tmp_path, groups, message):
    with pytest.raises(TaskError, match=message) as err:
        train(tmp_path, Grouped(groups), config(max_steps=2))
    assert "\n" not in str(err.value)


CUSTOM = {
    "optimizer": {"_target_": "torch.optim.RMSprop", "alpha": 0.95},
    "scheduler": {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 7, "gamma": 0.5},
}


def test_an_optimizer_and_scheduler_named_by_target_train_and_resume_bit_exactly(tmp_path):
    cfg = with_optim(config(every_steps=5), lr=0.01, **CUSTOM)
    whole = train(tmp_path / "whole", Grouped(), cfg)
    state = newest_shared_state(tmp_path / "whole")
    assert state["optimizer"]["param_groups"][0]["alpha"] == 0.95 and "square_avg" in next(iter(state["optimizer"]["state"].values()))
    assert state["schedule"]["step_size"] == 7 and state["schedule"]["last_epoch"] == whole.steps
    stopped = train(tmp_path / "cut", Grouped(), cfg, stop_at=12)
    resumed = train(tmp_path / "cut", Grouped(), cfg)
    assert resumed.resumed_from == stopped.steps == stopped_step(12)
    assert [s["loss"] for s in steps_of(tmp_path / "cut")] == [s["loss"] for s in steps_of(tmp_path / "whole")]
    assert resumed.val_metrics == whole.val_metrics


def test_a_scheduler_that_takes_total_steps_is_given_the_runs(tmp_path):
    cfg = with_optim(config(max_steps=9, every_steps=9), scheduler={"_target_": "torch.optim.lr_scheduler.OneCycleLR", "max_lr": 0.3})
    train(tmp_path, Regression(), cfg)  # OneCycleLR refuses to start without total_steps
    assert newest_shared_state(tmp_path)["schedule"]["total_steps"] == 9


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"optimizer": {"_target_": "torch.optim.RMSprop", "alfa": 0.9}},
            r"optim.optimizer.alfa: torch.optim.RMSprop takes no argument 'alfa'; it takes: alpha, eps",
        ),
        ({"optimizer": {"_target_": "torch.nn.Linear"}}, r"optim.optimizer._target_=torch.nn.Linear is not a torch.optim.optimizer.Optimizer"),
        ({"scheduler": {"_target_": "torch.optim.lr_scheduler.ReduceLROnPlateau"}}, r"steps on a metric; the toolkit steps schedulers once per optimizer step"),
        ({"scheduler": {"_target_": "tests.unit.test_task_hooks.Unsaveable"}}, r"optim.scheduler: the state of Unsaveable cannot be checkpointed safely"),
        ({"optimizer": {"_target_": "torch.optim.LBFGS"}}, r"optim.optimizer._target_=torch.optim.LBFGS: its step\(\) needs 'closure'"),
        (
            {"optimizer": {"_target_": "tests.unit.test_task_hooks.Sharpness"}},
            r"test_task_hooks.Sharpness: its step\(\) needs 'closure' .*use a first-order optimizer",
        ),
    ],
)
def test_a_bad_optimizer_or_scheduler_is_one_line_before_the_first_step(tmp_path, changes, message):
    with pytest.raises(TaskError, match=message) as err:
        train(tmp_path, Regression(), with_optim(config(max_steps=2), **changes))
    assert "\n" not in str(err.value) and not (tmp_path / "steps.jsonl").exists()


class Sharpness(torch.optim.SGD):
    """A SAM-style optimizer: its step evaluates the loss again through a closure it requires."""

    def step(self, closure):  # type: ignore[override]
        return super().step(closure)


class Unsaveable(torch.optim.lr_scheduler.LRScheduler):
    """A scheduler whose state holds an object: it would save, and never load as weights only."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.policy = OptimConfig()
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return list(self.base_lrs)


def small_lm(tmp_path: Path, dropout: float) -> Any:
    from trainers.data.tokens import embedded_corpus, write_token_file
    from trainers.tasks.lm import LanguageModelTask

    path = tmp_path / "tokens.h5"
    if not path.exists():
        write_token_file(embedded_corpus()[:30000], path)
    return LanguageModelTask(tokens=str(path), context=16, layers=2, heads=2, width=32, dropout=dropout)


def lm_config(checkpointing: bool, precision: str = "fp32") -> FitConfig:
    cfg = with_optim(config(max_steps=12, batch_size=8, every_steps=6), name="adamw", lr=3e-3, weight_decay=0.1)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, activation_checkpointing=checkpointing, precision=precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_activation_checkpointing_trains_bit_identically_to_keeping_activations(tmp_path, precision):
    """Recomputation replays dropout's random numbers and autocast, so nothing changes but memory;
    and it does recompute: every block's forward runs again in each training step's backward."""
    kept_task, kept_calls = counting_blocks(small_lm(tmp_path, dropout=0.1))
    recomputed_task, recomputed_calls = counting_blocks(small_lm(tmp_path, dropout=0.1))
    kept = train(tmp_path / "kept", kept_task, lm_config(False, precision))
    recomputed = train(tmp_path / "recomputed", recomputed_task, lm_config(True, precision))
    blocks, steps = 2, 12
    assert recomputed_calls[0] - kept_calls[0] == blocks * steps  # one recomputation per block and step, evaluation none
    assert [s["loss"] for s in steps_of(tmp_path / "recomputed")] == [s["loss"] for s in steps_of(tmp_path / "kept")]
    assert recomputed.val_metrics == kept.val_metrics
    model_kept, model_recomputed = newest_shared_state(tmp_path / "kept")["model"], newest_shared_state(tmp_path / "recomputed")["model"]
    assert all(torch.equal(model_kept[name], model_recomputed[name]) for name in model_kept)


def test_the_language_model_decays_matrices_only(tmp_path):
    train(tmp_path, small_lm(tmp_path, dropout=0.0), lm_config(False))
    groups = newest_shared_state(tmp_path)["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    assert len(groups[0]["params"]) == 2 + 2 * 4 + 1  # embeddings, 4 linear weights per block, the head


class Normed(Regression):
    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))

    def checkpointed_modules(self, model: nn.Module) -> list[nn.Module]:
        return [model]


@pytest.mark.parametrize(
    "task, message",
    [
        (
            Regression(),
            r"trainer.activation_checkpointing=true: tests.support.fit_in_process.Regression names no modules to recompute; define checkpointed_modules",
        ),
        (Normed(), r"activation checkpointing of a Sequential: its BatchNorm1d updates running statistics in forward"),
    ],
)
def test_activation_checkpointing_without_modules_or_with_batch_norm_is_one_line(tmp_path, task, message):
    cfg = config(max_steps=2)
    with pytest.raises(TaskError, match=message):
        train(tmp_path, task, dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, activation_checkpointing=True)))


def test_the_docs_optimizer_command_composes_and_passes_the_login_node_checks():
    import re
    import shlex

    from hpc.config.compose import compose_job
    from hpc.config.validate import validate_job
    from tests.support.runs import ROOT

    command = re.search(r"python launch\.py (\+optim\.optimizer\._target_=.*?)\n\s*```", (ROOT / "docs" / "your-code.md").read_text(), re.S)
    assert command, "docs/your-code.md shows a custom optimizer and scheduler"
    job = compose_job(shlex.split(command.group(1).replace("\\\n", " ")))  # a continued line
    assert job.optim.optimizer == {"_target_": "torch.optim.RMSprop", "alpha": 0.95}
    assert job.optim.scheduler["_target_"] == "torch.optim.lr_scheduler.OneCycleLR"
    validate_job(job)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["+optim.optimizer._target_=torch.optim.Nope"], r"optim.optimizer._target_=torch.optim.Nope: .*torch/optim/__init__.py defines no Nope"),
        (["+optim.optimizer._target_=nopkg.Lion"], r"optim.optimizer._target_=nopkg.Lion: no module 'nopkg' on the import path"),
        (["+optim.optimizer.alpha=0.9"], r"optim.optimizer has no _target_; name the class"),
        (
            ["+optim.optimizer._target_=torch.optim.LBFGS"],
            r"optim.optimizer._target_=torch.optim.LBFGS: its step\(\) needs 'closure'",
        ),  # re-exported by torch.optim
        (
            ["+optim.optimizer._target_=tests.unit.test_task_hooks.Sharpness"],
            r"Sharpness: its step\(\) needs 'closure' \(a closure that evaluates the loss again",
        ),
        (
            ["+optim.scheduler._target_=torch.optim.lr_scheduler.StepLR", "+optim.scheduler.stepsize=3"],
            r"optim.scheduler.stepsize: .*StepLR takes no argument 'stepsize'; it takes: step_size, gamma",
        ),
        (
            ["+optim.scheduler._target_=torch.optim.lr_scheduler.StepLR", "+optim.scheduler.step_size=3", "optim.warmup_steps=5"],
            r"optim.warmup_steps=5 is for the built-in schedules",
        ),
    ],
)
def test_a_bad_optimizer_or_scheduler_is_refused_on_the_login_node(overrides, message):
    from hpc.config.compose import compose_job
    from hpc.config.validate import validate_job
    from hpc.errors import UserError

    with pytest.raises(UserError, match=message) as err:
        validate_job(compose_job(overrides))
    assert "\n" not in str(err.value)


def test_a_custom_optimizer_from_torch_is_not_frozen_but_ones_from_a_users_package_are(tmp_path, monkeypatch):
    from hpc.launching.snapshot import user_sources

    package = tmp_path / "myopt"
    package.mkdir()
    (package / "__init__.py").write_text("class Lion: ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert user_sources(["torch.optim.RMSprop", "json.JSONDecoder", "myopt.Lion", "trainers.tasks.lm.LanguageModelTask"]) == [package]
