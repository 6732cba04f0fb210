"""Every project under examples/ runs the command its README gives, as written (CI runs them)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.support.runs import ROOT, run_dirs

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]
EXAMPLES = sorted(p.parent for p in (ROOT / "examples").glob("*/README.md"))


def readme_command(example_dir):  # type: ignore[no-untyped-def]
    text = (example_dir / "README.md").read_text()
    block = text[text.index("```bash\n") + len("```bash\n") : text.index("```", text.index("```bash\n") + 8)]
    (line,) = [line for line in block.splitlines() if line.strip()]
    return shlex.split(line)


def test_there_is_an_example_project():
    assert [p.name for p in EXAMPLES] == ["regression"]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_the_example_runs_as_its_readme_says(example, tmp_path):
    words = readme_command(example)
    assert words[0] == "PYTHONPATH=$PWD" and words[1] == "python"
    env = {**os.environ, "PYTHONPATH": str(example)}
    command = [sys.executable, *words[2:], f"run_root={tmp_path / 'runs'}"]
    done = subprocess.run(command, cwd=example, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert "within_3_sigma" in steps[-1] and epochs[-1]["val_within_3_sigma"] > 0.9 and epochs[-1]["val_loss"] < 0.01
    assert (run_dir / "code" / "linefit" / "tasks.py").read_text() == (example / "linefit" / "tasks.py").read_text()
