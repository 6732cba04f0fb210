"""A warm process (hpc.rank.warm) on this machine without Slurm, for tests/unit/test_warm.py and
tests/unit/test_parking.py: a light module list, and clients as srun's tasks would be
(hpc.rank.main's first lines) with Slurm's variables set by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc.env import WARM_VARIABLE
from hpc.rank.warm import CONNECT_VARIABLE
from tests.support.runs import ROOT

CLIENT = (  # hpc.rank.main's first lines, with the probe as the module
    "import os; from hpc.rank.signals import catch_stop_signals; catch_stop_signals(); from hpc.rank.warm import hand_over; "
    "hand_over(os.environ, 'tests.support.warm_probe'); print('cold', flush=True)"
)
SERVE = "import sys; from hpc.rank import warm; raise SystemExit(warm.main(sys.argv[1:]))"
MODULES = ("json", "tests.support.warm_probe_deps")


def alive(pid: int) -> bool:
    """Running (a zombie not yet reaped is not); it may be reaped while this looks."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # the state, after the name
    except OSError:  # ProcessLookupError, FileNotFoundError: gone
        return False


@pytest.fixture
def job_env() -> dict[str, str]:
    """A made-up Slurm task's environment: a job id of its own (the socket's name is global)."""
    slurm = {"SLURM_JOB_ID": str(uuid.uuid4().int % 10**9), "SLURMD_NODENAME": "warmnode"}
    return {**os.environ, **slurm, "PYTHONPATH": str(ROOT), WARM_VARIABLE: "t0ken", CONNECT_VARIABLE: "0.5"}


def start_warm(env: dict[str, str], *modules: str) -> subprocess.Popen[str]:
    """A warm process importing `modules`, once it listens."""
    server = subprocess.Popen([sys.executable, "-u", "-c", SERVE, *modules], env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    assert server.stdout.readline() == "hpc-warm: listening warmnode\n"
    return server


@pytest.fixture
def warm(job_env: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    server = start_warm(job_env, *MODULES)
    assert server.stdout is not None
    assert server.stdout.readline().startswith("hpc-warm: ready warmnode ")
    yield server
    if server.poll() is None:
        server.kill()
    server.wait()


def client(env: dict[str, str], *args: str, tmp: Path, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CLIENT, *args], env={**env, **extra}, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def said(process: subprocess.Popen[str]) -> dict:
    assert process.stdout is not None
    line = process.stdout.readline()
    return json.loads(line) if line.startswith("{") else {"line": line}
