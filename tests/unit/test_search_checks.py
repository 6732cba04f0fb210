"""hpc.config.search's rules, each at its boundary (issue 46: the mutation pass left these
unguarded): which values of a swept key stand for the rest, the sweeper's settings and their
defaults, Optuna's distributions from Hydra's grammar, and the refusals' words."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

from hpc.config import search
from hpc.config.compose import ConfigSource, fixed_overrides, sweeper_config
from hpc.config.search import MAX_EDGE_VALUES, OPTUNA_STUDY, check_search, edge_points, is_basic, make_sampler, search_space, study_settings, sweeper_name
from hpc.errors import UserError

SETTINGS = {"n_trials": 4, "n_jobs": 2, "sampler": {"_target_": "optuna.samplers.RandomSampler"}}


def edges_of(values: int) -> list[list[str]]:
    return edge_points([f"trainer.epochs=range(1,{values + 1})"], {})


def test_a_range_of_up_to_max_edge_values_is_composed_whole_and_a_longer_one_by_its_two_ends():
    assert MAX_EDGE_VALUES == 16  # the docs' "a long range: its first and last values"
    assert edges_of(MAX_EDGE_VALUES) == [[f"trainer.epochs={n}"] for n in range(1, MAX_EDGE_VALUES + 1)]
    assert edges_of(MAX_EDGE_VALUES + 1) == [["trainer.epochs=1"], [f"trainer.epochs={MAX_EDGE_VALUES + 1}"]]


def test_sweeper_names_come_from_hydra_plugins_module_and_the_basic_sweeper_is_told_apart():
    assert sweeper_name(OPTUNA_STUDY) == "optuna"
    assert sweeper_name("hydra_plugins.hydra_ax_sweeper.AxSweeper") == "ax"  # two dots are enough
    assert sweeper_name("hydra_plugins.hydra_nevergrad_sweeper.nevergrad_sweeper.NevergradSweeper") == "nevergrad"
    assert sweeper_name("my.custom.Sweeper") == "my.custom.Sweeper"  # not a Hydra plugin: named as written
    assert is_basic({}) is True and is_basic({"_target_": search.BASIC_SWEEPER}) is True
    assert is_basic({"_target_": OPTUNA_STUDY}) is False


def test_the_sweeper_settings_take_their_boundaries_and_keep_their_values():
    settings = study_settings({**SETTINGS, "n_trials": 1, "n_jobs": 1, "direction": ["maximize"], "max_failure_rate": 1.0})
    assert (settings.n_trials, settings.n_jobs, settings.direction, settings.max_failure_rate) == (1, 1, "maximize", 1.0)
    settings = study_settings({**SETTINGS, "n_trials": 7, "n_jobs": 3})
    assert (settings.n_trials, settings.n_jobs, settings.max_failure_rate, settings.direction) == (7, 3, 0.0, None)  # no rate given: none tolerated
    assert (settings.study_name, settings.storage) == ("search", None)
    assert study_settings({**SETTINGS, "direction": []}).direction is None
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field .n_trials."):
        settings.n_trials = 9  # type: ignore[misc]
    for sampler in ({}, {"seed": 1}, "tpe"):
        with pytest.raises(UserError, match="hydra.sweeper.sampler needs a _target_"):
            study_settings({**SETTINGS, "sampler": sampler})


def test_a_sampler_that_cannot_be_made_is_one_line_with_its_own_cause(monkeypatch):
    import hydra.utils

    def no_cause(config):
        raise ValueError("seed must be an int")

    def with_cause(config):
        raise RuntimeError("Error in call to target") from TypeError("bad argument 'sed'")

    target = {"_target_": "optuna.samplers.RandomSampler"}
    monkeypatch.setattr(hydra.utils, "instantiate", no_cause)
    with pytest.raises(UserError, match=r"^hydra.sweeper.sampler \(optuna.samplers.RandomSampler\): seed must be an int$"):
        make_sampler(target)
    monkeypatch.setattr(hydra.utils, "instantiate", with_cause)
    with pytest.raises(UserError, match=r": bad argument 'sed'$"):
        make_sampler(target)


def test_cma_es_without_its_package_is_refused_by_name_and_with_it_is_made(monkeypatch):
    real = importlib.util.find_spec
    cmaes = {"_target_": "optuna.samplers.CmaEsSampler"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cmaes" else real(name, *a))
    with pytest.raises(UserError, match="needs the cmaes package: pip install cmaes"):
        make_sampler(cmaes)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cmaes" else real(name, *a))
    try:
        make_sampler(cmaes)  # Optuna imports cmaes only when it samples
    except UserError as err:
        assert "needs the cmaes package" not in str(err)


def test_distributions_follow_the_types_of_both_ends_and_the_later_of_a_keys_two_places():
    space, _ = search_space(["optim.lr=interval(1,2.5)", "optim.momentum=range(0.5,3,1)"], {})
    from optuna.distributions import FloatDistribution, IntDistribution

    assert space == {"optim.lr": FloatDistribution(1.0, 2.5), "optim.momentum": FloatDistribution(0.5, 2.5, step=1.0)}
    assert search_space(["trainer.epochs=int(interval(1,3))"], {})[0] == {"trainer.epochs": IntDistribution(1, 3)}
    assert search_space(["optim.lr=interval(1,3)"], {})[0] == {"optim.lr": FloatDistribution(1.0, 3.0)}  # Hydra's interval: floats
    params = {"params": {"optim.momentum": "interval(0.5,0.9)", "optim.weight_decay": "interval(0,0.1)"}}
    space, _ = search_space(["optim.momentum=interval(0.6,0.8)"], params)
    assert list(space) == ["optim.weight_decay", "optim.momentum"]  # the command line's place, after params'
    assert space["optim.momentum"] == FloatDistribution(0.6, 0.8)


def test_a_search_of_one_edge_point_is_checked_and_conflicting_directions_say_which_way_is_better():
    arguments = ["model=choice(mlp)", "sweep.objective=loss"]
    found = check_search(arguments, sweeper_config(fixed_overrides(["hydra/sweeper=optuna", *arguments])))
    assert len(found.points) == 1 and found.direction == "minimize"
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field .objective."):
        found.objective = "val_loss"  # type: ignore[misc]  # launch.py's checked search, as checked
    arguments = ["optim.lr=interval(0.01,0.3)", "sweep.objective=val_accuracy", "hydra.sweeper.direction=minimize"]
    with pytest.raises(UserError, match="sweep.objective=val_accuracy is better higher, but hydra.sweeper.direction=minimize"):
        check_search(arguments, sweeper_config(fixed_overrides(["hydra/sweeper=optuna", *arguments])))
    arguments = ["optim.lr=interval(0.01,0.3)", "sweep.objective=loss", "hydra.sweeper.direction=maximize"]
    with pytest.raises(UserError, match="sweep.objective=loss is better lower, but hydra.sweeper.direction=maximize"):
        check_search(arguments, sweeper_config(fixed_overrides(["hydra/sweeper=optuna", *arguments])))


def test_a_search_whose_trials_would_run_on_different_clusters_is_refused(tmp_path):
    """`cluster` cannot be searched, but an experiment can choose it: two experiments, two clusters."""
    (tmp_path / "experiment").mkdir()
    for name, cluster in (("here", "local"), ("on_slurm", "simulated")):
        (tmp_path / "experiment" / f"{name}.yaml").write_text(f"# @package _global_\ndefaults:\n  - override /cluster: {cluster}\n")
    source = ConfigSource(config_dir=str(tmp_path))
    arguments = ["experiment=here,on_slurm", "sweep.objective=loss"]
    sweeper = sweeper_config(fixed_overrides(["hydra/sweeper=optuna", *arguments]), source)
    with pytest.raises(UserError, match="^a search runs on one cluster: every trial's cluster must be the same$"):
        check_search(arguments, sweeper, source)
    same = ["experiment=here,here", "sweep.objective=loss"]
    assert check_search(same, sweeper_config(fixed_overrides(["hydra/sweeper=optuna", *same]), source), source).points
