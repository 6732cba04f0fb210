"""A job is validated once on its way out (issue 47): hpc.app checks and pins it
(hpc.launching.launch.prepare), and what runs or submits it takes it as it is. Validating twice
read every HDF5 file's labels twice (an lru_cache hid it) and let the two checks drift."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.runs import ROOT

# hpc-launch in a fresh interpreter, with every call of validate_job counted
COUNTED = """
import json, sys
import hpc.config.validate as validate
from hpc import app
calls = []
original = validate.validate_job
def counted(job, *args, **kwargs):
    calls.append(job.optim.lr)
    return original(job, *args, **kwargs)
for module in list(sys.modules.values()):  # wherever it was imported by name
    if getattr(module, "validate_job", None) is original:
        module.validate_job = counted
try:
    app.main(sys.argv[1:])
finally:
    print(json.dumps(calls), file=sys.stderr)
"""


@pytest.mark.parametrize(("overrides", "validations", "shown"), [([], 1, "# resolved config"), (["-m", "optim.lr=0.1,0.2"], 2, "# point #1 (optim.lr=0.2")])
def test_a_job_and_each_sweep_point_are_validated_once(tmp_path, overrides, validations, shown):
    ran = subprocess.run(
        [sys.executable, "-c", COUNTED, *overrides, "dry_run=true", f"run_root={tmp_path / 'runs'}"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    calls = json.loads(ran.stderr.strip().splitlines()[-1])
    assert len(calls) == validations, calls
    assert shown in ran.stdout  # the dry run went through to its end
