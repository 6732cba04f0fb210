"""What a run dir's JSON files (result.json, job.json) promise a script that reads them."""

from __future__ import annotations

import json
import math

import pytest

from hpc.rundir import RunDir


def test_run_dir_json_is_strict_a_nan_loss_is_null(tmp_path):
    run = RunDir(tmp_path)
    run.write_json(run.result, {"loss": math.nan, "test_metrics": {"loss": math.inf, "close": 0.5}, "steps": [1.0, -math.inf]})
    text = run.result.read_text()
    parsed = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in result.json"))  # strict: no NaN/Infinity
    assert parsed == {"loss": None, "test_metrics": {"loss": None, "close": 0.5}, "steps": [1.0, None]}
