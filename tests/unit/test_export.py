"""python -m trainers.export: a run's model weights as safetensors, loaded again in a fresh process
that has torch but not the toolkit (the README's reader, run as written)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig

import pytest
import torch
from torch import nn

from hpc.run import start_run
from tests.support.docs import marked_blocks
from tests.support.fit_in_process import Regression, train
from tests.support.fit_in_process import config as task_config
from tests.support.ranks import one_rank  # noqa: F401  (autouse: a world of one)
from trainers.checkpoint.checkpointer import load_tensor_file
from trainers.checkpoint.export import export, load, main, write_safetensors
from trainers.checkpoint.layout import SHARED, step_dir_name


def readme_reader() -> str:
    """The Python block of the docs' export section: a safetensors reader in plain torch."""
    reader, _ = marked_blocks("docs/checkpoints.md", __file__)
    return reader.body


def test_a_run_s_model_exported_loads_in_plain_torch_without_the_toolkit(tmp_path, capsys):
    result = train(tmp_path / "run", Regression(), task_config(max_steps=5))
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "model.safetensors")]) == 0
    assert "model of checkpoint step 5 (2 tensors, 2 values; task " in capsys.readouterr().out
    saved = load_tensor_file(tmp_path / "run" / "checkpoints" / step_dir_name(result.steps) / SHARED)["state"]["model"]

    # A fresh interpreter without site's path hooks: torch from site-packages, the toolkit nowhere.
    code = readme_reader().replace("model.safetensors", str(tmp_path / "model.safetensors"))
    code += "\nimport importlib.util, json\nassert importlib.util.find_spec('trainers') is None and importlib.util.find_spec('hpc') is None\n"
    code += "print(json.dumps({'weights': {k: v.tolist() for k, v in weights.items()}, 'metadata': metadata}))\n"
    purelib = sysconfig.get_paths()["purelib"]
    done = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env={"PYTHONPATH": purelib}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert loaded["weights"] == {name: tensor.tolist() for name, tensor in saved.items()}
    assert loaded["metadata"]["hpctk_step"] == "5" and json.loads(loaded["metadata"]["hpctk_task"])["name"] == "regression"
    model = nn.Linear(1, 1)
    model.load_state_dict(load(tmp_path / "model.safetensors")[0])  # the toolkit's own reader agrees


def builtin_mlp_block() -> str:
    """The docs' second Python block of the export section: the built-in MLP rebuilt in plain torch."""
    _, mlp = marked_blocks("docs/checkpoints.md", __file__)
    return mlp.body


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_docs_rebuild_the_exported_builtin_mlp_in_plain_torch(dropout):
    """The documented layout of model=mlp (issue 45: it was undocumented), checked against the
    toolkit's own model: the same names, and the same outputs once the weights are loaded."""
    from trainers.config import ModelConfig
    from trainers.models import build_model

    torch.manual_seed(0)
    ours = build_model(ModelConfig(name="mlp", hidden_sizes=[32, 16], dropout=dropout), (1, 8, 8), 10).eval()
    namespace: dict = {}
    exec(compile(builtin_mlp_block(), "docs/checkpoints.md", "exec"), namespace)
    weights = {name: tensor.detach().clone() for name, tensor in ours.state_dict().items()}
    rebuilt = namespace["builtin_mlp"](weights)
    images = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8)
    assert torch.equal(rebuilt(images.float() * (1 / 255)), ours(images.float() * (1 / 255)))


def test_a_script_s_checkpoint_names_its_modules_and_exports_the_one_asked_for(tmp_path, capsys):
    torch.manual_seed(0)
    generator, critic = nn.Linear(2, 3, dtype=torch.bfloat16), nn.Linear(3, 1)
    optimizer = torch.optim.SGD(critic.parameters(), lr=0.1)
    run = start_run(tmp_path / "run", generator=generator, critic=critic, optimizer=optimizer)
    run.end_step(loss=1.0)
    run.finish()
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "g.safetensors")]) == 2
    assert "error: the checkpoint registers 2 modules ('critic', 'generator'): choose one with --state NAME" in capsys.readouterr().err
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "g.safetensors"), "--state", "optimizer"]) == 2
    assert "that state holds no module weights" in capsys.readouterr().err
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "g.safetensors"), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint step 7 in" in err and "(it keeps steps 1)" in err
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "g.safetensors"), "--state", "generator"]) == 0
    weights, metadata = load(tmp_path / "g.safetensors")
    assert weights["weight"].dtype == torch.bfloat16 and torch.equal(weights["weight"], generator.weight.detach())
    assert metadata["hpctk_state"] == "generator"


@pytest.mark.parametrize(("args", "message"), [(["--best"], "keeps no best checkpoint"), ([], "holds no committed checkpoint")])
def test_what_cannot_be_exported_is_said_in_one_line(tmp_path, capsys, args, message):
    (tmp_path / "checkpoints").mkdir()
    assert main([str(tmp_path), "--out", str(tmp_path / "m.safetensors"), *args]) == 2  # bad input: exit 2, as every command of the toolkit
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_header_keeps_the_tensor_bytes_8_byte_aligned_whatever_its_length(tmp_path):
    """safetensors' rule: readers that map the file (safetensors itself) need aligned tensors."""
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.float64)}
    for padding in range(9):
        path = tmp_path / f"m{padding}.safetensors"
        write_safetensors(path, tensors, {"note": "x" * padding})
        size = int.from_bytes(path.read_bytes()[:8], "little")
        assert size % 8 == 0, (padding, size)
        weights, metadata = load(path)
        assert metadata == {"note": "x" * padding} and all(torch.equal(weights[k], tensors[k]) for k in tensors)


def test_a_corrupted_checkpoint_is_skipped_for_the_newest_good_one_or_refused_when_asked_for(tmp_path, capsys):
    train(tmp_path / "run", Regression(), task_config(max_steps=4, every_steps=2))  # steps 2 and 4
    newest = tmp_path / "run" / "checkpoints" / step_dir_name(4) / SHARED
    newest.write_bytes(newest.read_bytes()[:-1] + b"\0")  # one byte: its checksum no longer holds
    out = tmp_path / "nested" / "dir" / "model.safetensors"  # folders made as needed
    assert main([str(tmp_path / "run"), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"skipping {step_dir_name(4)}: " in captured.err and "of checkpoint step 2 " in captured.out
    assert load(out)[1]["hpctk_step"] == "2"
    assert main([str(tmp_path / "run"), "--out", str(out), "--step", "4"]) == 1  # asked for by name: refused, not replaced
    assert f"error: {step_dir_name(4)}" in capsys.readouterr().err
    assert export(tmp_path / "run", tmp_path / "again.safetensors")["step"] == 2  # from Python: the newest good one too
    assert main([str(tmp_path / "run"), "--out", str(out), "--step", "2"]) == 0 and load(out)[1]["hpctk_step"] == "2"
    with pytest.raises(SystemExit) as refused:  # --out is required
        main([str(tmp_path / "run")])
    assert refused.value.code == 2 and "--out" in capsys.readouterr().err


def test_a_script_s_one_registered_module_is_exported_without_naming_it(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    run = start_run(tmp_path / "run", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    run.end_step(loss=1.0)
    run.finish()
    written = export(tmp_path / "run", tmp_path / "m.safetensors")
    weights, metadata = load(tmp_path / "m.safetensors")
    assert written["state"] == metadata["hpctk_state"] == "model" and set(weights) == {"weight", "bias"}
    assert torch.equal(weights["weight"], model.weight.detach())


def test_fsdp2_rows_are_exported_whole_from_a_script_and_from_the_builtin_loop(tmp_path):
    """A script's fully_shard model leaves markers in shared.ckpt and its rows in the ranks'
    files; the built-in loop's comm.sharding=full keeps only buffers in shared.ckpt. Either way the
    export holds every parameter whole, equal to the model's own (a gloo world of one)."""
    import dataclasses

    from torch.distributed.fsdp import fully_shard

    from collectives.config import CommConfig
    from collectives.torchdist import TorchDistCollectives
    from tests.support.fit_in_process import builtin_task
    from tests.support.ranks import gloo_world_of_one

    with gloo_world_of_one(tmp_path / "store"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
        whole = {name: value.detach().clone() for name, value in model.state_dict().items()}
        fully_shard(model)
        run = start_run(tmp_path / "script", model=model)
        run.end_step(loss=1.0)
        run.finish()
        cfg = dataclasses.replace(task_config(max_steps=2, every_steps=2), comm=CommConfig(backend="gloo", sharding="full"))
        task = builtin_task(cfg)
        train(tmp_path / "loop", task, cfg, TorchDistCollectives("gloo", torch.device("cpu")))
    shared = load_tensor_file(next((tmp_path / "script" / "checkpoints").glob("step-*")) / SHARED)
    assert any(isinstance(value, dict) for value in shared["state"]["model"].values())  # markers where the rows were
    export(tmp_path / "script", tmp_path / "script.safetensors")
    weights, _ = load(tmp_path / "script.safetensors")
    assert set(weights) == set(whole) and all(torch.equal(weights[name], value) for name, value in whole.items())
    export(tmp_path / "loop", tmp_path / "loop.safetensors")
    weights, _ = load(tmp_path / "loop.safetensors")
    expected = task.build_model().state_dict()
    assert {name: tuple(value.shape) for name, value in weights.items()} == {name: tuple(value.shape) for name, value in expected.items()}
