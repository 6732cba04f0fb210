"""Fixtures. Under CI=true a missing MPI or Slurm is a failure, never a skip; a Slurm test's
leftover jobs are cancelled so that they cannot hold nodes the next test needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from hpc.config.local_gpus import machine_gpus
from hpc.slurm.slurmctl import TERMINAL_STATES, job_state

IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_configure(config: pytest.Config) -> None:
    """auto's tuning tables and the remembered run roots go to the session's own dirs (inherited by
    mpirun ranks and Slurm jobs), never to the home of whoever runs the tests. The suite's jobs are a CPU machine's, as
    on CI: on a machine with GPUs, cluster=local would run every default job on them, one rank
    per GPU (hpc.config.local_gpus), so the session sees none (tests of that counting set their own)."""
    os.environ.setdefault("HPCTK_CACHE", tempfile.mkdtemp(prefix="hpc-toolkit-cache-"))
    # the run roots every launch remembers (hpc.runroots): the session's, not the home's
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="hpc-toolkit-state-")
    if machine_gpus().count:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that submit to Slurm form one pytest-xdist group (scripts/test.sh runs the suite
    with `-n 3 --dist loadgroup`): one worker runs them one after another, since they share the
    simulated cluster's nodes and `needs_slurm` cancels every job a test leaves, while the other
    workers run the rest. A rank's start or a launcher is one busy core, and a Slurm test mostly
    waits for Slurm: beside it, two streams of the others fill the two cores."""
    for item in items:
        if item.get_closest_marker("slurm") is not None or "needs_slurm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.get_closest_marker("net") is not None:
            # One emulated rail fabric per machine (fixed namespace names): a test's `down` on
            # one worker removed the namespaces another worker's `up` was building (seen in CI).
            item.add_marker(pytest.mark.xdist_group("net"))


TIER_SECONDS: dict[str, list[float]] = {}  # tier (tests/<tier>/...) -> [seconds, tests, CPU seconds]
TEST_SECONDS: dict[str, float] = {}  # node id -> setup + call + teardown
TEST_CPU_SECONDS: dict[str, float] = {}  # node id -> the CPU its phases took (cpu_seconds)
PHASE_STARTED_CPU = pytest.StashKey[float]()


def cpu_seconds() -> float:
    """CPU this process used, and every process it started that has ended and been waited for,
    with theirs (launch.py, mpirun and the ranks under it, torchrun and its workers): the suite's
    bound on 2 cores, where the ranks' start-up is most of it. Not a Slurm job's (its processes
    are slurmd's)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item):  # type: ignore[no-untyped-def]  # a hook wrapper's generator
    item.stash[PHASE_STARTED_CPU] = cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item):  # type: ignore[no-untyped-def]
    """The CPU of each phase (setup, call, teardown: one after the other, each ended by its
    report) travels with its report: an xdist worker's reach the controller."""
    outcome = yield
    now = cpu_seconds()
    outcome.get_result().user_properties.append(("cpu_s", now - item.stash.get(PHASE_STARTED_CPU, now)))
    item.stash[PHASE_STARTED_CPU] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup, call and teardown of every test, added up by tier for the summary below."""
    parts = report.nodeid.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    totals = TIER_SECONDS.setdefault(tier, [0.0, 0, 0.0])
    cpu = sum(float(value) for name, value in report.user_properties if name == "cpu_s")
    totals[0] += report.duration
    totals[1] += report.when == "call"
    totals[2] += cpu
    TEST_SECONDS[report.nodeid] = TEST_SECONDS.get(report.nodeid, 0.0) + report.duration
    TEST_CPU_SECONDS[report.nodeid] = TEST_CPU_SECONDS.get(report.nodeid, 0.0) + cpu


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Each tier's share of the suite's time: the budget (CI's 90 minutes, 30 wanted) is watched
    by tier. With several workers (pytest -n) a tier's time is its tests' total, more than the
    wall time pytest prints."""
    if hasattr(terminalreporter.config, "workerinput") or not TIER_SECONDS:
        return  # a pytest-xdist worker: its controller hears every report and sums them
    total = sum(seconds for seconds, _, _ in TIER_SECONDS.values())
    total_cpu = sum(cpu for _, _, cpu in TIER_SECONDS.values())
    by_time = sorted(TIER_SECONDS.items(), key=lambda kv: -kv[1][0])
    shown = ", ".join(f"{tier} {seconds / 60:.1f} min ({tests} tests)" for tier, (seconds, tests, _) in by_time)
    terminalreporter.write_line(f"time by tier: {shown}; all {total / 60:.1f} min")
    shown = ", ".join(f"{tier} {cpu / 60:.1f} min" for tier, (_, _, cpu) in by_time)
    terminalreporter.write_line(f"CPU by tier (the tests' processes, not Slurm's): {shown}; all {total_cpu / 60:.1f} min")
    # Every test's time and CPU, for the budget's next cut: .pytest_cache/v/hpc/test-seconds, test-cpu-seconds
    if getattr(terminalreporter.config, "cache", None) is not None:  # none under -p no:cacheprovider (scripts/test-ranges.sh)
        terminalreporter.config.cache.set("hpc/test-seconds", dict(sorted(TEST_SECONDS.items(), key=lambda kv: -kv[1])))
        terminalreporter.config.cache.set("hpc/test-cpu-seconds", dict(sorted(TEST_CPU_SECONDS.items(), key=lambda kv: -kv[1])))


def require(condition: bool, what: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI (scripts/test.sh installs and starts it)")
    pytest.skip(f"{what} not available")


def slurm_is_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    out = subprocess.run(["sinfo", "-h", "-p", "debug", "-N", "-o", "%T"], capture_output=True, text=True)
    return out.returncode == 0 and any(state in out.stdout for state in ("idle", "mixed", "allocated"))


def queued_jobs() -> dict[str, str]:
    """Job id -> working directory of every job Slurm still knows."""
    out = subprocess.run(["squeue", "-h", "-o", "%A %Z"], capture_output=True, text=True)
    rows = (line.split(" ", 1) for line in out.stdout.splitlines()) if out.returncode == 0 else ()
    return {row[0]: row[1] if len(row) > 1 else "" for row in rows}


@pytest.fixture(scope="session")
def s3_variables() -> dict[str, str]:
    """The S3-compatible server up (scripts/s3-sim.sh: moto's; started if it is not), and the
    standard variables that reach it."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "s3-sim.sh"
    started = subprocess.run([str(script), "start"], capture_output=True, text=True, timeout=60)
    require(started.returncode == 0, f"an S3-compatible server ({started.stderr.strip()})")
    listed = subprocess.run([str(script), "env"], check=True, capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in listed.split())


@pytest.fixture
def s3(s3_variables: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """An s3:// URL of this test's own, the variables that reach its server set."""
    import uuid

    for name, value in s3_variables.items():
        monkeypatch.setenv(name, value)
    return f"s3://hpctk-tests/{uuid.uuid4().hex}"


@pytest.fixture
def needs_mpi() -> None:
    from collectives.mpirun import find_mpirun

    require(find_mpirun() is not None, "mpirun")


@pytest.fixture
def needs_slurm(tmp_path: Path):
    """A running Slurm; the jobs a test leaves queued or running are cancelled after it (under CI,
    where the Slurm tests run one at a time, every new job; elsewhere those submitted from its
    tmp_path)."""
    require(slurm_is_up(), "a running Slurm cluster (scripts/slurm-sim.sh start)")
    before = set(queued_jobs())
    yield
    leftover = sorted(job for job, workdir in queued_jobs().items() if job not in before and (IN_CI or workdir.startswith(str(tmp_path))))
    if not leftover:
        return
    subprocess.run(["scancel", *leftover], capture_output=True)
    deadline = time.monotonic() + 60
    while set(queued_jobs()) & set(leftover) and time.monotonic() < deadline:
        time.sleep(0.2)  # squeue offers no event for a job leaving the queue


def wait_until_done(job_id: str, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in TERMINAL_STATES:
            return state
        time.sleep(0.5)  # polling squeue: Slurm offers no completion event to wait on
    pytest.fail(f"job {job_id} still {job_state(job_id)} after {timeout_s} s")
