"""Lightning and Hugging Face scripts without hpc.lightning / hpc.hf run under launch.py as any
script does: the examples with their one import put back to the framework's own train to the end
on two local ranks (Lightning finds its TorchElasticEnvironment in the variables launch.py sets,
HF's Trainer runs DDP over gloo), the run dir says completed, and the toolkit commits no
checkpoint of its own (the frameworks' own saving and resume are theirs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runs import ROOT, run_dirs

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# The adapters' import line in each example, and the framework's own that a script without them has.
UNCHANGED = {
    "lightning": ("from hpc.lightning import DataLoader, Trainer", "from pytorch_lightning import Trainer\nfrom torch.utils.data import DataLoader"),
    "hf_trainer": ("from hpc.hf import Trainer", "from transformers import Trainer"),
}
# What each framework prints at its end (its own words, so the framework ran its loop to the end).
FINISHED = {"lightning": "`Trainer.fit` stopped: `max_steps=12` reached.", "hf_trainer": "'train_runtime'"}


def without_adapter(example: str, into: Path) -> Path:
    source = (ROOT / "examples" / example / "train.py").read_text()
    ours, theirs = UNCHANGED[example]
    assert ours in source, f"examples/{example}/train.py no longer imports {ours!r}"
    script = into / "train.py"
    script.write_text(source.replace(ours, theirs))
    return script


@pytest.mark.parametrize("example", sorted(UNCHANGED))
def test_a_framework_script_without_the_adapter_runs_as_any_script(example, tmp_path):
    script = without_adapter(example, tmp_path)
    args = ["--max-steps", "12"] + (["--eval-every", "6", "--train-size", "320"] if example == "hf_trainer" else ["--val-every", "6"])
    command = [sys.executable, str(ROOT / "launch.py"), f"script={script}", f"run_root={tmp_path / 'runs'}", "resources.tasks_per_node=2", "--", *args]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    (run_dir,) = run_dirs(tmp_path)
    assert FINISHED[example] in output + "".join(log.read_text() for log in (run_dir / "logs").glob("rank-*.log")), output[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["world_size"]) == ("completed", 2), result
    assert not list(run_dir.glob("checkpoints/*/COMMITTED"))  # no run handle: the toolkit saved nothing
