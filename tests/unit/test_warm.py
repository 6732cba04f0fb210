"""Warm ranks (hpc.rank.warm) on this machine, without Slurm: a warm process with a light module
list, and clients as srun's tasks would be (hpc.rank.main's first lines), with Slurm's variables
set by hand. The Slurm restarts that use it: tests/e2e/test_allocation_restart_slurm.py and
tests/e2e/test_verify_slurm.py (a spare node's ranks and killed ranks forked warm, bit-exact)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.simcluster import poll
from hpc.env import WARM_IMPORTS_VARIABLE, WARM_VARIABLE
from hpc.rank.warm import CONNECT_VARIABLE
from tests.support.runs import ROOT
from tests.support.warmserver import MODULES, alive, client, said, start_warm


def test_the_fork_runs_in_the_clients_place_and_its_exit_code_is_the_clients(warm, job_env, tmp_path):
    started = client(job_env, "a b", "c", tmp=tmp_path, PROBE_X="the client's", PROBE_CODE="7")
    out, err = started.communicate(timeout=30)
    probe = json.loads(out.splitlines()[0])
    assert started.returncode == 7 and "cold" not in out
    assert probe["argv"] == ["a b", "c"] and probe["cwd"] == str(tmp_path) and probe["x"] == "the client's"
    assert probe["pid"] != started.pid and probe["forked"].startswith("a fork of this node's warm process")
    assert "to stderr" in err  # the client's own streams


def test_each_fork_draws_its_own_unseeded_random_streams(job_env, tmp_path):
    # a fork has its warm process's torch and numpy streams: two ranks' unseeded augmentations were equal
    server = start_warm(job_env, *MODULES, "numpy.random", "torch")
    try:
        draws = []
        for _ in range(2):
            out, _ = client(job_env, tmp=tmp_path).communicate(timeout=60)
            draws.append(json.loads(out.splitlines()[0])["draws"])
        assert set(draws[0]) == {"numpy", "torch"}
        assert all(draws[0][name] != draws[1][name] for name in ("numpy", "torch")), draws
    finally:
        server.kill()
        server.wait()


def test_a_fork_that_os_exits_gives_its_client_its_exit_code(warm, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="os_exit", PROBE_CODE="70")  # a watchdog's verdict
    started.communicate(timeout=30)
    assert started.returncode == 70  # srun says "Exited with exit code 70", not "Killed"


def test_a_child_of_the_fork_never_speaks_for_it(warm, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="forks", PROBE_CODE="6")
    started.communicate(timeout=30)
    assert started.returncode == 6  # the rank's code, not its child's 0


def test_what_the_fork_left_behind_ends_with_it(warm, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="leaves_child")
    said(started)
    assert started.stdout is not None
    leftover = int(started.stdout.readline())
    assert started.wait(timeout=30) == 0
    poll(lambda: not alive(leftover), "the rank's leftover child to end", 20)  # as Slurm ended a step's processes


def test_the_warm_process_outlives_the_jobs_stop_signals(warm, job_env, tmp_path):
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        warm.send_signal(sig)  # scancel --signal, hpc.stop: for the ranks, not for it
    started = client(job_env, tmp=tmp_path, PROBE_CODE="2")
    out, _ = started.communicate(timeout=30)
    assert started.returncode == 2 and json.loads(out.splitlines()[0])["forked"] and warm.poll() is None


@pytest.mark.parametrize("told", ["SIGTERM", "stdin closed"])
def test_told_to_end_the_warm_process_forks_no_more_and_ends_once_its_ranks_have(warm, job_env, tmp_path, told):
    saving = client(job_env, tmp=tmp_path, PROBE="usr1")  # a rank still saving when Slurm's SIGTERM came
    said(saving)
    if told == "SIGTERM":  # scancel, a preemption: its forks must outlive it, it must not outlive them
        warm.send_signal(signal.SIGTERM)
    else:  # the batch shell, dead of the same SIGTERM, closed the FIFO
        assert warm.stdin is not None
        warm.stdin.close()

    def later_starts_cold() -> bool:
        out, _ = client(job_env, tmp=tmp_path).communicate(timeout=30)
        return out.strip() == "cold"

    poll(later_starts_cold, "a client after SIGTERM to start cold", 20)
    assert warm.poll() is None  # the rank it forked still runs
    saving.send_signal(signal.SIGUSR1)
    assert saving.wait(timeout=30) == 40 + signal.SIGUSR1
    assert warm.wait(timeout=30) == 0


def test_sigterm_ends_a_warm_process_without_ranks_at_once(warm):
    warm.send_signal(signal.SIGTERM)  # scancel: Slurm's KillWait is not spent waiting on it
    assert warm.wait(timeout=30) == 0


def test_an_error_in_the_fork_is_exit_code_1_with_its_traceback(warm, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="raise")
    _, err = started.communicate(timeout=30)
    assert started.returncode == 1 and "RuntimeError: the probe's own error" in err


def test_a_signal_to_the_client_reaches_the_fork(warm, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="usr1")
    said(started)
    started.send_signal(signal.SIGUSR1)
    assert started.wait(timeout=30) == 40 + signal.SIGUSR1


def test_a_fork_killed_kills_its_client_with_the_same_signal(warm, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="sleep")
    os.kill(said(started)["pid"], signal.SIGKILL)
    assert started.wait(timeout=30) == -signal.SIGKILL  # srun reports "task N: Killed", as for a cold rank


def test_a_client_killed_takes_its_fork_with_it(warm, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="sleep")
    fork = said(started)["pid"]
    started.kill()
    started.wait()
    poll(lambda: not alive(fork), "the fork to end with its client", 20)
    assert warm.poll() is None  # the warm process stays for the next start


@pytest.mark.parametrize("change", [{WARM_VARIABLE: "not-the-token"}, {"SLURMD_NODENAME": "another-node"}, {WARM_VARIABLE: ""}])
def test_a_client_the_warm_process_does_not_take_starts_cold(warm, job_env, tmp_path, change):
    started = client({**job_env, **change}, tmp=tmp_path)
    out, _ = started.communicate(timeout=30)
    assert started.returncode == 0 and out.strip() == "cold"


def test_the_warm_process_ends_when_its_standard_input_does(warm, job_env, tmp_path):
    assert warm.stdin is not None
    warm.stdin.close()
    assert warm.wait(timeout=30) == 0
    started = client(job_env, tmp=tmp_path)
    out, _ = started.communicate(timeout=30)
    assert out.strip() == "cold"  # nothing listens any more


def test_a_client_that_comes_while_the_warm_process_imports_waits_for_its_fork(job_env, tmp_path):
    server = start_warm(job_env, *MODULES, "tests.support.warm_slow_import")  # 1 s of import after it listens
    try:
        started = client(job_env, tmp=tmp_path, PROBE_CODE="3")
        out, _ = started.communicate(timeout=30)
        assert started.returncode == 3 and json.loads(out.splitlines()[0])["forked"], out
    finally:
        server.kill()
        server.wait()


def test_a_warm_process_whose_imports_fail_sends_its_waiting_clients_cold(job_env, tmp_path):
    server = start_warm(job_env, "tests.support.warm_slow_import", "no_such_module_here")
    started = client(job_env, tmp=tmp_path)  # queued before the import fails
    out, _ = started.communicate(timeout=30)
    assert server.wait(timeout=30) == 1 and "hpc-warm: failed warmnode: importing no_such_module_here: ModuleNotFoundError" in server.stdout.read()
    assert started.returncode == 0 and out.strip() == "cold"


def test_the_warm_step_runs_the_ranks_python_and_asks_for_the_nodes_gpus():
    from hpc.slurm.environment import job_cpus_per_node
    from hpc.slurm.warmnodes import STEP_NAME, warm_program, warm_step

    ranks = ["srun", "--unbuffered", "--mpi=pmix", "/opt/py/bin/python3", "-u", "-m", "hpc.rank.main", "/runs/r"]
    assert warm_program(ranks) == ["/opt/py/bin/python3", "-u", "-m", "hpc.rank.warm"]
    assert warm_program(["srun", "--container-image=img", "python3", "-u", "-m", "hpc.rank.main", "/runs/r"]) is None  # a container's Python
    assert warm_program(["srun", "apptainer", "exec", "x.sif", "python3", "-u", "-m", "hpc.rank.main", "/runs/r"]) is None
    step = warm_step("node7", ["/opt/py/bin/python3", "-u", "-m", "hpc.rank.warm"], gpus=8, cpus=96)
    assert step[:4] == ["srun", f"--job-name={STEP_NAME}", "--cpus-per-task=96", "--gres=gpu:8"] and "--nodelist=node7" in step and "--overlap" in step
    assert not [word for word in warm_step("node7", ["python"]) if word.startswith(("--gres", "--cpus"))]
    assert job_cpus_per_node({"SLURM_JOB_CPUS_PER_NODE": "96(x3),64"}) == 64 and job_cpus_per_node({}) is None


def test_a_client_that_comes_before_the_warm_process_listens_waits_for_it(job_env, tmp_path):
    early = client({**job_env, CONNECT_VARIABLE: "20"}, tmp=tmp_path, PROBE_CODE="4")  # the ranks' srun started beside the warm one
    server = start_warm(job_env, *MODULES)
    try:
        out, _ = early.communicate(timeout=30)
        assert early.returncode == 4 and json.loads(out.splitlines()[0])["forked"], out
    finally:
        server.kill()
        server.wait()


FAKE_SRUN = """#!/bin/bash
# srun as the batch script's warm lines run it: says it listens, holds on until its input ends
for arg; do [[ $arg == --nodelist=* ]] && node=${arg#--nodelist=}; done
printf '%s\\n' "$@" >"$FAKE_LOG/$node.args"
echo "hpc-warm: listening $node"
[[ $node == n3 ]] && { echo "hpc-warm: failed n3: importing torch: ImportError: no torch here"; exit 1; }
cat >/dev/null
echo ended >"$FAKE_LOG/$node.eof"
"""


def test_the_batch_script_starts_a_warm_step_per_node_which_the_supervisor_adopts_and_its_trap_ends(tmp_path):
    from hpc.slurm.batch import exit_trap_lines
    from hpc.slurm.warmnodes import BatchStep, WarmNodes, batch_start_lines

    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[[ \"$1 $2\" == 'show hostnames' ]] && printf 'n1\\nn2\\nn3\\n'\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    program = [sys.executable, "-u", "-m", "hpc.rank.warm"]
    adopt = (  # the supervisor, as submitit starts it after the setup lines
        "import json, os, sys; from hpc.slurm.warmnodes import WarmNodes; "
        f"warm = WarmNodes.adopt({program!r}, os.environ, 2); print(json.dumps([warm.token, sorted(warm.steps), warm.env(), sorted(warm.broken)]))"
    )
    trap = [line for line in exit_trap_lines(0) if "hpctk_warm_in" in line]  # the trap's first deed
    script = "\n".join(
        [
            *batch_start_lines(program, gpus=2),
            'until grep -qs failed "$HPCTK_WARM_DIR"/n3.out; do sleep 0.05; done',
            f"{shlex.quote(sys.executable)} -c {shlex.quote(adopt)}",
            'echo "token $HPCTK_WARM"',
            *[line.strip() for line in trap],
            "wait",
        ]
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "FAKE_LOG": str(log),
        "TMPDIR": str(tmp_path),
        "HPCTK_WARM_RANKS": "1",
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": "2",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURM_JOB_CPUS_PER_NODE": "4(x2),2",
    }
    env.pop(WARM_VARIABLE, None)
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) >= 2, (done.stdout, done.stderr)
    said_json, token_line = done.stdout.splitlines()[-2:]
    token, steps, ranks_env, broken = json.loads(said_json)
    assert token_line == f"token {token}" and len(token) == 32 and steps == ["n1", "n2", "n3"]
    assert ranks_env == {WARM_VARIABLE: token} and broken == ["n3"]  # n3 said it failed: its ranks start cold, never started again
    assert "warm ranks: hpc-warm: failed n3" in done.stderr
    for node in ("n1", "n2"):
        args = (log / f"{node}.args").read_text().split()
        assert {"--job-name=hpc-warm", "--cpus-per-task=2", "--gres=gpu:2", f"--nodelist={node}", "--overlap"} <= set(args)
        assert (log / f"{node}.eof").read_text() == "ended\n"  # its input ended with the trap's close, not before
    assert not list(tmp_path.glob("hpctk-warm.*"))  # the trap removed the directory
    assert WarmNodes.adopt(program, {}, 0) is None and BatchStep("n1", 2**22 + 1, tmp_path / "none").poll() == 0
    steps = tmp_path / "other" / "steps"
    steps.parent.mkdir()
    steps.write_text(f"job 77 2\nn1 {os.getpid()}\n")  # this pid is no srun of n1's warm step: ended
    theirs = {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2", WARM_VARIABLE: "t", "HPCTK_WARM_DIR": str(steps.parent)}
    adopted = WarmNodes.adopt(program, theirs, 0)
    assert adopted is not None and adopted.steps["n1"].poll() == 0
    for other in ({"SLURM_JOB_ID": "78"}, {"SLURM_RESTART_COUNT": "3"}):  # an enclosing job's, an earlier start's
        assert WarmNodes.adopt(program, {**theirs, **other}, 0) is None


# A local run's warm process (hpc.launching.ranks): stand-ins for it, as the launcher sees them.


def test_a_local_warm_process_still_importing_ends_at_once_after_mpirun(tmp_path):
    # its standard input is read only after its imports: a second Ctrl-C or an mpirun that failed
    # at once would have waited for torch's import (up to WARM_END_S)
    from hpc.launching.ranks import end_warm_process

    importing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    began = time.monotonic()
    end_warm_process(importing)
    assert importing.returncode == -signal.SIGTERM and time.monotonic() - began < 10


def test_a_local_warm_process_that_ends_at_once_leaves_the_ranks_cold_in_one_line(capsys):
    from hpc.launching.ranks import warm_listens

    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert warm_listens(ended) is False
    assert capsys.readouterr().err == "hpc-warm: ended at once (exit code 3) (every rank starts its own interpreter)\n"


def test_the_frameworks_launch_names_are_imported_before_the_fork_and_only_those_allowed(job_env, tmp_path):
    # As launch.py names a script's frameworks (hpc.env.WARM_IMPORTS_VARIABLE); this warm process
    # allows a stand-in and one that is not installed, and is also named a module it does not allow.
    allowed = ("tests.support.warm_framework", "tests.support.no_such_framework")
    serve = f"import sys; from hpc.rank import warm; warm.WARM_FRAMEWORKS = {allowed!r}; raise SystemExit(warm.main(sys.argv[1:]))"
    named = "tests.support.no_such_framework,tests.support.warm_slow_import,tests.support.warm_framework"
    env = {**job_env, WARM_IMPORTS_VARIABLE: named}
    server = subprocess.Popen([sys.executable, "-u", "-c", serve, *MODULES], env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        told = [server.stdout.readline() for _ in range(3)]
        assert told[0] == "hpc-warm: listening warmnode\n" and told[2].startswith("hpc-warm: ready warmnode "), told
        assert told[1].startswith("hpc-warm: not imported here: tests.support.no_such_framework: ModuleNotFoundError"), told  # and the ranks still fork
        started = client(job_env, tmp=tmp_path, PROBE_MODULES="tests.support.warm_framework,tests.support.warm_slow_import")
        probe = said(started)
        assert started.wait(timeout=30) == 0
        assert probe["had"] == {"tests.support.warm_framework": True, "tests.support.warm_slow_import": False}, probe
        assert probe["forked"].endswith(", tests.support.warm_framework imported there"), probe  # the rank's log says so
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("named", ["", "torch._dynamo"])
def test_a_fork_has_torch_dynamos_stand_in_unless_launch_named_the_real_one(job_env, tmp_path, named):
    # launch.py names torch._dynamo for a job that compiles, runs DDP or a script (hpc.launching.launch.warm_imports)
    env = {**job_env, WARM_IMPORTS_VARIABLE: named}
    server = start_warm(env, "torch")
    try:
        assert server.stdout is not None
        assert server.stdout.readline().startswith("hpc-warm: ready warmnode ")
        started = client(job_env, tmp=tmp_path)
        probe = said(started)
        assert started.wait(timeout=30) == 0
        assert probe["dynamo"] == ("module" if named else "StandIn"), probe
        assert probe["forked"].endswith(", torch._dynamo imported there") is bool(named), probe
    finally:
        server.kill()
        server.wait()
