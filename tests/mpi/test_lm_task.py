"""`python launch.py task=lm`: the built-in GPT-style model on the embedded corpus, two MPI ranks."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.runs import run_dirs, run_launch

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]


def test_task_lm_learns_on_two_ranks_from_the_embedded_corpus(tmp_path):
    done = run_launch("task=lm", "trainer.max_steps=40", "checkpoint.every_minutes=null", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert len(steps) == 40 and steps[0]["loss"] > 5.0  # about log(256) = 5.5 at the start
    assert sum(s["loss"] for s in steps[-5:]) / 5 < 0.6 * steps[0]["loss"]  # clearly falling
    config = (run_dir / "config.yaml").read_text()
    assert "name: adamw" in config and "tokens: /" in config  # task=lm brings AdamW; the corpus file is pinned
    result = json.loads((run_dir / "result.json").read_text())
    assert result["world_size"] == 2 and result["val_metrics"]["perplexity"] == pytest.approx(math.exp(result["val_metrics"]["loss"]))
