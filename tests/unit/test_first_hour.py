"""What a new user meets in the first hour on the login node (issue 14): `+key` overrides go
through the schema, data that does not fit the model is refused before any run dir exists,
Hydra's flags parse in both forms, nothing is left behind, and the help and README are true."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpc.config.compose import CONF_DIR, compose_job, option_help, sweep_points
from hpc.config.schema import to_job_config
from hpc.config.validate import check_resources, validate_job
from hpc.errors import UserError
from hpc.launching.sweep import discard_unsubmitted
from hpc.launching.tidy import note_run_root, prune_empty
from hpc.rundir import RUN_MARKER
from tests.support.docs import marked_blocks
from tests.support.runs import ROOT, run_launch

OPTIM_KEYS = "valid keys in 'optim': name, lr, momentum"


def launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """launch.py with flags before the overrides (run_launch puts run_root last)."""
    return run_launch(*args, cwd=cwd, timeout=120)


def assert_refused(result: subprocess.CompletedProcess[str], fragment: str, cwd: Path) -> None:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert not (cwd / "runs").exists(), sorted((cwd / "runs").rglob("*"))


# 1. `+key=value` and `++key=value` meet the schema like `key=value` does.


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+optim.lrr=0.5", f"unknown key 'optim.lrr'; {OPTIM_KEYS}"),
        ("++optim.lrr=0.5", f"unknown key 'optim.lrr'; {OPTIM_KEYS}"),
        ("+model._target_=my.Model", "unknown key 'model._target_'; valid keys in 'model': name, hidden_sizes"),
        ("+epochs=3", "unknown key 'epochs'; valid keys in the root config: cluster, resources"),
    ],
)
def test_added_keys_the_schema_lacks_are_refused(override, message):
    with pytest.raises(UserError, match=re.escape(message)):
        compose_job([override])
    with pytest.raises(UserError, match=re.escape(message)):
        sweep_points([override, "optim.lr=0.1,0.2"])


def test_adding_to_a_free_form_mapping_and_forcing_a_declared_key_still_work():
    job = compose_job(["+cluster.env.MY_VAR=1", "++optim.lr=0.5"])
    assert job.cluster.env == {"MY_VAR": "1"} and job.optim.lr == 0.5


def test_a_composed_config_with_an_undeclared_key_is_refused():
    """The ranks' and the sweep launcher's path: Hydra composed it, to_job_config must not drop the key."""
    with pytest.raises(UserError, match=re.escape("unknown key 'trainer.epoch'; valid keys in 'trainer': epochs")):
        to_job_config({"trainer": {"epoch": 3}})


def test_launch_refuses_an_added_unknown_key_in_one_line(tmp_path):
    assert_refused(launch("+optim.lrr=0.5", cwd=tmp_path), f"unknown key 'optim.lrr'; {OPTIM_KEYS}", tmp_path)
    assert_refused(launch("-m", "+optim.lrr=0.5,0.6", cwd=tmp_path), "unknown key 'optim.lrr'", tmp_path)


# 2. Data that does not fit the model, refused on the login node.


def write_h5(path: Path, train_x, train_y, test_x=None, test_y=None, num_classes: int | None = None) -> Path:
    with h5py.File(path, "w") as f:
        f["train/x"], f["train/y"] = train_x, train_y
        f["test/x"] = train_x[:8] if test_x is None else test_x
        f["test/y"] = train_y[:8] if test_y is None else test_y
        if num_classes:
            f.attrs["num_classes"] = num_classes
    return path


BAD_DATA = {
    "nhw": (
        dict(train_x=np.zeros((64, 8, 8), np.uint8), train_y=np.zeros(64, np.int64)),
        "model=cnn",
        "model=cnn needs images N x C x H x W, but train/x is N x 8 x 8",
    ),
    "nhwc": (
        dict(train_x=np.zeros((64, 8, 8, 3), np.uint8), train_y=np.zeros(64, np.int64)),
        "model=cnn",
        "train/x is N x 8 x 8 x 3, which looks channels-last (N x H x W x C); model=cnn expects N x C x H x W",
    ),
    "labels": (
        dict(train_x=np.zeros((64, 1, 8, 8), np.uint8), train_y=np.arange(64) % 4 + 1, num_classes=4),
        "model=mlp",
        "labels in train/y run 1..4, outside 0..3 for num_classes=4",
    ),
    "test_labels": (
        dict(train_x=np.zeros((64, 4)), train_y=np.arange(64) % 3, test_x=np.zeros((8, 4)), test_y=np.full(8, -1)),
        "model=mlp",
        "labels in test/y run -1..-1, outside 0..2",
    ),
    "features": (
        dict(train_x=np.zeros((64, 64)), train_y=np.zeros(64, np.int64), test_x=np.zeros((8, 32)), test_y=np.zeros(8, np.int64)),
        "model=mlp",
        "train inputs (64,) and validation inputs (32,) differ in shape",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_data_that_does_not_fit_the_model_is_refused_before_anything_is_made(tmp_path, case):
    arrays, model, message = BAD_DATA[case]
    path = write_h5(tmp_path / f"{case}.h5", **arrays)
    job = compose_job([f"data.path={path}", model, "data.batch_size=4"])
    with pytest.raises(UserError, match=re.escape(message)):
        validate_job(job)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.crop=12"], "data.crop=12 is larger than the 8 x 8 images padded by 0; crop at most 8"),
        (["data.crop_padding=2"], "data.crop_padding=2 pads for a random crop: set data.crop too"),
        (["data.workers=-1"], "data.workers=-1 must be >= 0"),
        (["data.prefetch=0"], "data.prefetch=0 >= 1"),
        (["data.path=/nonexistent/shards-*.h5"], "data.path '/nonexistent/shards-*.h5' matches no file"),
        (["task=lm", "data.flip=true"], "data.flip augments the built-in classify task only"),
    ],
)
def test_loading_and_augmentation_settings_are_checked_before_anything_runs(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        validate_job(compose_job(overrides))


def test_a_crop_with_padding_may_take_the_whole_image(tmp_path):
    path = write_h5(tmp_path / "ok.h5", np.zeros((64, 3, 8, 8), np.uint8), np.arange(64) % 4, num_classes=4)
    assert validate_job(compose_job([f"data.path={path}", "model=cnn", "data.batch_size=4", "data.crop=10", "data.crop_padding=1"])) is not None


def test_images_in_the_right_layout_pass_for_every_model(tmp_path):
    path = write_h5(tmp_path / "ok.h5", np.zeros((64, 3, 8, 8), np.uint8), np.arange(64) % 4, num_classes=4)
    for model in ("mlp", "cnn"):
        assert validate_job(compose_job([f"data.path={path}", f"model={model}", "data.batch_size=4"])).num_classes == 4


def test_labels_are_checked_chunk_by_chunk(tmp_path):
    """Large label arrays are read a slice at a time; the range covers every slice."""
    from trainers.data.datasets import DataError, inspect_hdf5, label_range

    labels = np.zeros(1000, np.int64)
    labels[100], labels[500] = 7, -2  # neither in the last slice
    path = write_h5(tmp_path / "late.h5", np.zeros((1000, 4)), labels, test_y=np.zeros(8, np.int64), num_classes=8)
    with h5py.File(path) as f:
        assert label_range(f["train/y"], chunk=64) == (-2, 7)
    with pytest.raises(DataError, match=re.escape("labels in train/y run -2..7, outside 0..7")):
        inspect_hdf5(path, compose_job([]).data)


def test_launch_refuses_unfit_data_before_making_a_run_dir(tmp_path):
    path = write_h5(tmp_path / "nhw.h5", **BAD_DATA["nhw"][0])
    for args, message in (
        (["model=cnn"], "model=cnn needs images N x C x H x W"),
        (["-m", "optim.lr=0.1,0.2", "model=cnn"], "sweep point #0 (optim.lr=0.1 model=cnn"),
    ):
        done = launch(*args, f"data.path={path}", cwd=tmp_path)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
        assert [entry.name for entry in tmp_path.iterdir()] == ["nhw.h5"]  # refused before any run or sweep dir


def test_the_data_checks_stay_torch_free(tmp_path):
    path = write_h5(tmp_path / "nhwc.h5", **BAD_DATA["nhwc"][0])
    probe = (
        "import sys\nfrom hpc.config.compose import compose_job\nfrom hpc.config.validate import check_data\n"
        f"try:\n    check_data(compose_job(['model=cnn', 'data.path={path}']))\nexcept Exception as err:\n    print(err)\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "channels-last" in done.stdout and done.stdout.strip().endswith("NO_TORCH"), done.stdout + done.stderr


# 3. Hydra's flags with a value, in both forms.


@pytest.fixture
def user_conf(tmp_path):
    """A user's config dir with a cluster of their own and a primary config of their own."""
    extra = tmp_path / "myconf"
    (extra / "cluster").mkdir(parents=True)
    (extra / "cluster" / "mine.yaml").write_text((CONF_DIR / "cluster" / "simulated.yaml").read_text().replace("name: simulated", "name: mine"))
    (extra / "myconfig.yaml").write_text("defaults:\n  - config\n  - _self_\nname: myname\n")
    return extra


@pytest.mark.parametrize("form", ["space", "equals"])
def test_config_dir_and_config_name_parse_in_both_forms(tmp_path, user_conf, form):
    def flag(name: str, value: str) -> list[str]:
        return [name, value] if form == "space" else [f"{name}={value}"]

    done = launch(*flag("--config-dir", str(user_conf)), *flag("--config-name", "myconfig"), "cluster=mine", "dry_run=true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "name: mine" in done.stdout and "_myname/" in done.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("form", ["space", "equals"])
def test_config_path_parses_in_both_forms(tmp_path, form):
    conf = tmp_path / "conf-copy"
    shutil.copytree(CONF_DIR, conf)
    (conf / "model" / "wide.yaml").write_text("name: mlp\nhidden_sizes: [1024]\nchannels: []\ndropout: 0.0\n")
    args = ["--config-path", str(conf)] if form == "space" else [f"--config-path={conf}"]
    done = launch(*args, "--cfg", "job", "model=wide", cwd=tmp_path)
    assert done.returncode == 0 and "- 1024" in done.stdout, done.stderr
    checked = launch(*args, "model=wide", "+model.depth=3", cwd=tmp_path)  # the pre-check composes from it too
    assert_refused(checked, "unknown key 'model.depth'", tmp_path)


def test_a_missing_config_dir_is_one_line(tmp_path):
    assert_refused(launch("--config-dir", str(tmp_path / "nope"), cwd=tmp_path), "--config-dir", tmp_path)


# 4. Nothing left behind; a closed stdout ends quietly.


@pytest.mark.parametrize(
    ("args", "stdout"),
    [
        (["dry_run=true"], "pipe"),
        (["cluster=simulated", "dry_run=true"], "closed"),
        (["-m", "optim.lr=0.1,0.2", "dry_run=true"], "pipe"),
        (["-m", "optim.lr=0.1,0.2", "cluster=simulated", "dry_run=true"], "closed"),
    ],
)
def test_dry_runs_leave_no_folder_and_a_closed_stdout_ends_quietly(tmp_path, args, stdout):
    (tmp_path / "runs").mkdir()  # an existing run root stays, and stays empty
    command = [sys.executable, str(ROOT / "launch.py"), *args, f"run_root={tmp_path / 'runs'}"]
    if stdout == "pipe":
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout, done.stderr
    else:  # `launch.py ... | head -1` with head gone before the first line: deterministic
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            done = subprocess.run(command, cwd=tmp_path, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(write_end)
        assert done.returncode == 141 and done.stderr == "", done.stderr
    assert (tmp_path / "runs").is_dir() and list((tmp_path / "runs").iterdir()) == []


def test_prune_stops_at_what_existed_and_at_anything_not_empty(tmp_path, monkeypatch):
    monkeypatch.setattr("hpc.launching.tidy._EXISTING", set())
    root = tmp_path / "scratch" / "runs"
    note_run_root(root)  # only tmp_path exists yet
    made = root / "2026-01-01" / "12-00-00_train"
    made.mkdir(parents=True)
    other = root / "2026-01-01" / "12-00-01_train"
    other.mkdir()
    prune_empty(made)
    assert not made.exists() and other.is_dir()  # a sibling run keeps the date folder
    prune_empty(other)
    assert not (tmp_path / "scratch").exists() and tmp_path.is_dir()


def test_a_sweep_that_submitted_nothing_is_removed_but_a_submitted_one_stays(tmp_path, monkeypatch):
    monkeypatch.setattr("hpc.launching.tidy._EXISTING", {tmp_path})
    sweep = tmp_path / "sweeps" / "day" / "time_train"
    for name in ("0/config.yaml", "1/config.yaml", "code/launch.py", "multirun.yaml", RUN_MARKER, f"0/{RUN_MARKER}"):
        (sweep / name).parent.mkdir(parents=True, exist_ok=True)
        (sweep / name).write_text("x")
    discard_unsubmitted(sweep, [0, 1])
    assert list(tmp_path.iterdir()) == []
    (sweep / "0").mkdir(parents=True)
    (sweep / "sweep.json").write_text("{}")
    discard_unsubmitted(sweep, [0])
    assert (sweep / "0").is_dir()


# 5. Advice that works.


def test_too_many_cpus_per_node_names_fixes_that_lower_them():
    job = compose_job(["cluster=simulated", "resources.tasks_per_node=5"])
    with pytest.raises(UserError, match=r"lower resources\.tasks_per_node or resources\.cpus_per_task") as err:
        check_resources(job)
    assert "add nodes" not in str(err.value)


def test_the_docs_error_examples_are_what_launch_prints():
    (block,) = marked_blocks("docs/running-jobs.md", __file__)
    examples = re.findall(r"\$ python launch\.py (.*)\n(error: .*)\n", block.body)
    assert len(examples) * 2 == len(block.body.splitlines())  # every line of the block is checked
    assert len(examples) >= 2
    for overrides, printed in examples:
        with pytest.raises(UserError, match=re.escape(printed.removeprefix("error: "))) as err:
            validate_job(compose_job(overrides.split()))
        assert f"error: {err.value}" == printed


# 6. Help and the README's table name every option.


def test_help_gives_every_group_option_a_line_of_its_own(tmp_path):
    done = launch("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for path in sorted(CONF_DIR.glob("*/*.yaml")):
        description = option_help(path)
        assert description, f"{path} has no '# help:' line"
        assert re.search(rf"^{path.parent.name}:$(\n  .*)*\n  {path.stem} +{re.escape(description)}$", done.stdout, re.M), path


def test_the_docs_config_group_table_lists_every_option():
    table = dict(re.findall(r"^\| `(\w+)` \| (`.*?`) \|", (ROOT / "docs" / "running-jobs.md").read_text(), re.M))
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "experiment"):
        listed = set(re.findall(r"`(\w+)`", table.get(group.name, "")))
        assert listed == {p.stem for p in group.glob("*.yaml")}, group.name
