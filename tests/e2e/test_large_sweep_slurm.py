"""A sweep of more points than the cluster's MaxArraySize (5 on the simulated cluster,
scripts/slurm-sim.sh) goes out as several arrays whose task ids stay below it, the throttle
holding for the whole sweep (each array after the first waits for the one before it), and
completes; hpc.status lists every point as one sweep."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc.slurm.slurmctl import job_fields, max_array_size
from tests.conftest import wait_until_done
from tests.support.runs import ROOT

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("needs_slurm")]


def test_a_sweep_beyond_max_array_size_is_split_into_arrays_and_completes_as_one_sweep(tmp_path):
    largest = max_array_size()
    assert largest == 5  # the simulated cluster's: scripts/slurm-sim.sh
    # A stdlib module as the script (`python -m platform`): the ranks start, nothing trains
    command = [sys.executable, str(ROOT / "launch.py"), "-m", "cluster=simulated", "resources.tasks_per_node=1", "script=platform"]
    command += ["sweep.max_parallel=2", f"run_root={tmp_path / 'runs'}", f"optim.lr=range(1,{largest + 3})"]  # 7 points: arrays of 5 and 2
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    arrays = re.findall(r"submitted job array (\d+): (\d) tasks .*, at most 2 at once", done.stdout)
    assert [tasks for _, tasks in arrays] == ["5", "2"], done.stdout
    (first, _), (second, _) = arrays
    assert job_fields(second)["Dependency"].startswith(f"afterany:{first}")  # the throttle holds across arrays
    sweep_dir = Path(re.search(r"sweep directory: (\S+)", done.stdout).group(1))
    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert [p["job_id"] for p in record["points"]] == [f"{first}_{i}" for i in range(5)] + [f"{second}_{i}" for i in range(2)]
    assert {wait_until_done(point["job_id"]) for point in record["points"]} == {"COMPLETED"}
    listing = subprocess.run([sys.executable, "-m", "hpc.status", "--json", str(sweep_dir)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert [(run["run"], run["state"]) for run in json.loads(listing.stdout)] == [(str(i), "COMPLETED") for i in range(7)]
