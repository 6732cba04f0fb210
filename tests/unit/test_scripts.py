"""script= on the login node (hpc.config.scripts): the three forms, found and parsed without
importing anything, one-line refusals, arguments after `--` kept verbatim through config.yaml,
torchrun's variables, and the stop of a script raised in its main thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from hpc.config.schema import to_job_config
from hpc.config.scripts import Script, check_script, frameworks_imported, literal, parse_script, split_passthrough, with_script_args
from hpc.config.validate import validate_job
from hpc.env import WARM_IMPORTS_VARIABLE, RankInfo
from hpc.errors import UserError
from hpc.launching.launch import rank_environment, resolved_yaml
from hpc.launching.snapshot import freeze_job_code
from hpc.rank.script import ScriptStopped, raising_stops, torchrun_environment
from tests.support.runs import ROOT

SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "ddp" / "train.py"


def test_the_three_forms_parse_as_a_user_would_start_them(tmp_path):
    assert parse_script("train.py", tmp_path) == Script(path=tmp_path / "train.py")
    assert parse_script("sub/run", tmp_path) == Script(path=tmp_path / "sub" / "run")
    assert parse_script("pkg.train", tmp_path) == Script(module="pkg.train")
    assert parse_script("pkg.train:main", tmp_path) == Script(module="pkg.train", function="main")
    for bad in ("", "pkg train", "pkg.train:", "pkg.train:main()", "1pkg.x"):
        with pytest.raises(UserError, match="script="):
            parse_script(bad, tmp_path)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_script_is_found_and_parsed_without_being_imported(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    # Importing these would raise: only their sources are read.
    write(tmp_path / "mypkg" / "__init__.py", "raise RuntimeError('imported')\n")
    write(tmp_path / "mypkg" / "train.py", "raise RuntimeError('imported')\ndef main():\n    pass\n")
    write(tmp_path / "mypkg" / "__main__.py", "raise RuntimeError('imported')\n")
    assert check_script("mypkg.train:main", tmp_path).function == "main"
    assert check_script("mypkg.train", tmp_path).module == "mypkg.train"
    assert check_script("mypkg", tmp_path).module == "mypkg"  # python -m mypkg: its __main__.py
    assert "mypkg" not in sys.modules
    write(tmp_path / "broken.py", "def f(:\n")
    refusals = {
        "missing.py": "no such file",
        "mypkg.train:run": "defines no function run at its top level",
        "mypkg.nothing": "no module 'mypkg.nothing' on the import path",
        "nopkg.train:main": "no module 'nopkg' on the import path",
        "broken.py": "broken.py line 1",
    }
    for spec, fragment in refusals.items():
        with pytest.raises(UserError, match=fragment):
            check_script(spec, tmp_path)
    (tmp_path / "mypkg" / "__main__.py").unlink()
    with pytest.raises(UserError, match="a package without __main__.py"):
        check_script("mypkg", tmp_path)


def test_a_script_in_a_directory_of_thousands_of_sources_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("hpc.config.scripts.MAX_FROZEN_FILES", 3)
    for name in ("a", "b", "c"):
        write(tmp_path / "lib" / f"{name}.py", "")
    write(tmp_path / "train.py", "")
    with pytest.raises(UserError, match="holds 4 source files, all frozen with the job"):
        check_script("train.py", tmp_path)


def test_a_script_and_a_task_are_refused_together_and_nothing_else_of_the_task_is_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = replace(to_job_config({}), script=str(SCRIPT), data=replace(to_job_config({}).data, path=str(tmp_path / "absent.h5")))
    assert validate_job(job) is None  # the built-in task's data is not the script's business
    with pytest.raises(UserError, match="both say what runs on the ranks; give one of them"):
        validate_job(replace(job, task={"_target_": "mytasks.noisy.Noisy"}))
    with pytest.raises(UserError, match="workdir=.*no such directory"):
        validate_job(replace(job, workdir=str(tmp_path / "gone")))


@settings(max_examples=60, deadline=None)  # a config round trip: tens of ms, more on a loaded machine
@given(st.lists(st.text(alphabet=st.sampled_from(["\\", "$", "{", "}", "a", " ", "'", '"', ",", "=", ":"]), max_size=12), max_size=4))
def test_script_arguments_survive_config_yaml_verbatim(args):
    job = replace(to_job_config({}), script="train.py", script_args=args)
    assert to_job_config(OmegaConf.create(resolved_yaml(job))).script_args == args


def test_literal_escapes_only_what_omegaconf_would_interpolate():
    assert literal("${HOME}") == "\\${HOME}"
    assert literal("a\\b") == "a\\b"  # a backslash elsewhere is literal to OmegaConf already
    assert literal("\\${x}") == "\\\\\\${x}"


def test_arguments_after_the_double_dash_go_to_the_script_only():
    assert split_passthrough(["a=1", "b=2"]) == (["a=1", "b=2"], None)
    assert split_passthrough(["a=1", "--", "--lr", "0.1", "--", "x"]) == (["a=1"], ["--lr", "0.1", "--", "x"])
    assert split_passthrough(["--"]) == ([], [])
    job = to_job_config({})
    assert with_script_args(job, None) is job
    with pytest.raises(UserError, match="go to a script, and none is given: add script=train.py"):
        with_script_args(job, ["--lr", "0.1"])
    assert with_script_args(replace(job, script="t.py"), ["--lr"]).script_args == ["--lr"]


def test_torchrun_variables_come_from_the_ranks_place():
    rank = RankInfo(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2, hosts=("n1", "n2"), launcher="slurm")
    env = torchrun_environment(rank, ("n1", 21234), "4242", restarts=2)
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "21234",
        "TORCHELASTIC_RUN_ID": "4242",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # "True" would make rank 0 a client of a store nobody serves
    }
    assert RankInfo.from_env({**env, "LOCAL_WORLD_SIZE": "2"}).rank == 3  # what the toolkit itself reads back


def test_a_stop_signal_is_raised_once_in_the_scripts_main_thread():
    caught, before = [], signal.getsignal(signal.SIGUSR1)
    with raising_stops((signal.SIGUSR1,)) as received:
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            for _ in range(1000):  # the handler runs at the next bytecode
                pass
        except ScriptStopped as stopped:
            caught.append(str(stopped))
            os.kill(os.getpid(), signal.SIGUSR1)  # during the script's clean-up: noted, not raised again
    assert caught == ["SIGUSR1"] and received == ["SIGUSR1", "SIGUSR1"]
    assert signal.getsignal(signal.SIGUSR1) == before  # the rank's own handler back


def test_a_script_files_directory_is_frozen_with_the_job(tmp_path):
    job = replace(to_job_config({}), script=str(SCRIPT), workdir=str(tmp_path))
    code = freeze_job_code(tmp_path / "code", job)
    assert sorted(p.name for p in (code / "script").iterdir()) == ["model.py", "scale.txt", "train.py"]
    assert (code / "script" / "scale.txt").resolve() == SCRIPT.parent / "scale.txt"  # data: a link to the live file
    assert (code / "script" / "train.py").read_text() == SCRIPT.read_text()


def test_launch_refuses_a_scripts_options_before_the_double_dash_and_arguments_without_a_script(tmp_path):
    def launch(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(ROOT / "launch.py"), f"run_root={tmp_path / 'runs'}", *args]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    for args, fragment in (
        ((f"script={SCRIPT}", "--lr", "0.1"), "unrecognized arguments: --lr 0.1 (a script's own arguments go after --"),
        (("dry_run=true", "--", "--lr", "0.1"), "arguments after -- (--lr 0.1) go to a script, and none is given"),
        (("script=nothere.py",), "script=nothere.py: no such file"),
    ):
        done = launch(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and fragment in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()
    shown = launch(f"script={SCRIPT}", "dry_run=true", "--", "--out", "${HOME}")
    assert shown.returncode == 0 and "script_args:\n- --out\n- \\${HOME}" in shown.stdout, shown.stdout[-1500:] + shown.stderr


def test_a_stopped_run_says_what_it_saved_as_its_result_tells(tmp_path):
    from hpc.launching.launch import stopped_line
    from hpc.rundir import RunDir

    run_dir = RunDir(tmp_path)
    command = f"bash {tmp_path / 'command.txt'}"
    for result, line in (
        ({"script": "t.py", "handle": False, "steps": 0}, f"stopped; to start the script again (it resumes from what it saved itself): {command}"),
        ({"script": "t.py", "handle": True, "steps": 7}, f"stopped with a committed checkpoint at step 7; to resume: {command}"),
        ({"steps": 0}, f"stopped before its first checkpoint; to start it again: {command}"),
        ({"steps": 40}, f"stopped with a committed checkpoint at step 40; to resume: {command}"),
    ):
        run_dir.write_json(run_dir.result, result)
        assert stopped_line(run_dir) == line
    run_dir.result.write_text("[")  # unreadable: nothing claimed
    assert stopped_line(run_dir) == f"stopped before its first checkpoint; to start it again: {command}"


def test_a_folder_named_as_the_script_is_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "tools").mkdir()  # a folder, no __init__.py, no __main__.py: `python -m tools` fails too
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"^script=tools: tools is a folder without __init__.py or __main__.py; name a file \(tools/train.py\)"):
        check_script("tools", tmp_path)
    with pytest.raises(UserError, match=r"^script=tools/: .*/tools is a folder; name the .py file to run in it$"):
        check_script("tools/", tmp_path)
    (tmp_path / "tools" / "__main__.py").write_text("print('hi')\n")
    assert check_script("tools", tmp_path).module == "tools"  # as `python -m tools` runs it


def test_a_run_root_with_a_file_on_its_way_is_refused(tmp_path):
    from hpc.config.validate import check_run_root

    (tmp_path / "notes").write_text("")
    for run_root in (tmp_path / "notes", tmp_path / "notes" / "runs"):
        with pytest.raises(UserError, match=rf"^run_root={run_root}: {tmp_path / 'notes'} is a file, not a directory$"):
            check_run_root(str(run_root))
    check_run_root(str(tmp_path / "new" / "runs"))  # made when the run starts


def test_a_scripts_terminal_is_the_launching_commands_not_mpiruns(monkeypatch):
    import io

    from hpc.rank.script import as_launched

    primary, secondary = os.openpty()  # what Open MPI gives a local rank, wherever launch.py's output goes
    try:
        for name in ("stdout", "stderr"):
            monkeypatch.setattr(sys, name, io.TextIOWrapper(io.FileIO(secondary, "w", closefd=False), encoding="utf-8"))
        as_launched("0")  # launch.py's output went to a file or a pipe
        assert not sys.stdout.isatty() and not sys.stderr.isatty() and sys.stdout.line_buffering
        print("whole", file=sys.stdout)
        assert os.read(primary, 100).replace(b"\r", b"") == b"whole\n"
        monkeypatch.setattr(os, "environ", {name: value for name, value in os.environ.items() if name != "COLUMNS"})  # this test's own
        as_launched("132")  # a terminal 132 columns wide
        assert os.environ["COLUMNS"] == "132" and os.get_terminal_size(secondary).columns == 0  # mpirun's pty has none
        os.environ["COLUMNS"] = "80"
        as_launched("132")
        assert os.environ["COLUMNS"] == "80"  # the user's own kept
    finally:
        os.close(primary)
        os.close(secondary)


def test_a_script_module_in_the_working_directory_is_found_and_frozen_as_python_m_finds_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the run root, relative, is left out of the copy
    (tmp_path / "probe_train.py").write_text("print('trained')\n")
    assert check_script("probe_train", tmp_path).module == "probe_train"  # `torchrun -m probe_train` from here runs it
    job = replace(to_job_config({}), script="probe_train", workdir=str(tmp_path))
    code = freeze_job_code(tmp_path / "code", job)
    assert (code / "probe_train.py").read_text() == "print('trained')\n"  # on the ranks' PYTHONPATH, frozen
    with pytest.raises(UserError, match=rf"^script=nothere: no module 'nothere' on the import path or in {tmp_path};"):
        check_script("nothere", tmp_path)


def test_the_ranks_start_in_the_frozen_copy_of_a_script_of_the_launch_dir_unless_workdir_is_given(tmp_path, monkeypatch):
    """pin_inputs leaves workdir unset for a script file of the launch dir (the ranks then start
    in its frozen copy: hpc.rank.script.starting_dir); a script elsewhere, or workdir= given, pins
    the directory the ranks start in (the run itself: tests/mpi/test_user_script.py)."""
    from hpc.config.schema import JobConfig
    from hpc.launching.launch import pin_inputs
    from hpc.rank.script import starting_dir

    (tmp_path / "train.py").write_text("")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    here = pin_inputs(JobConfig(script="train.py"), None)
    assert (here.script, here.workdir) == (str(tmp_path / "train.py"), None)
    assert pin_inputs(JobConfig(script="train.py", workdir="."), None).workdir == str(tmp_path)
    assert pin_inputs(JobConfig(script="elsewhere/train.py"), None).workdir == str(tmp_path)
    code = tmp_path / "run" / "code"
    (code / "script").mkdir(parents=True)
    script = parse_script(here.script, tmp_path)
    assert starting_dir(None, script, code) == code / "script" and starting_dir(str(tmp_path), script, code) == tmp_path
    assert starting_dir(None, script, tmp_path / "unfrozen") == tmp_path  # a hand-typed srun of an old run dir: beside the script


def test_the_frameworks_a_script_imports_are_named_for_the_warm_process_and_nothing_else():
    source = (
        "import os, pytorch_lightning as pl\n"
        "from . import helpers\n"  # relative: the user's own
        "from transformers import GPT2Config, Trainer\n"
        "import mypkg.transformers\n"  # a user's module of the same name, below a package of theirs
        "def main():\n"
        "    from hpc.lightning import Trainer\n"
        "    import pytorch_lightning.callbacks\n"
    )
    assert frameworks_imported(source) == ["pytorch_lightning", "transformers", "transformers.trainer", "hpc.lightning"]
    assert frameworks_imported("import torch\nfrom transformers import GPT2Config\n") == ["transformers"]  # no Trainer: its module stays out
    assert frameworks_imported("import torch, numpy\n") == []
    assert frameworks_imported("def broken(:\n") == []  # the rank's own import says why


def test_launch_hands_the_warm_process_the_frameworks_of_a_script_and_torch_dynamo_where_the_ranks_need_it(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text("from hpc.hf import Trainer\n")
    (tmp_path / "t.py").write_text("import pytorch_lightning\n")
    monkeypatch.chdir(tmp_path)

    def job(**changes: object):  # type: ignore[no-untyped-def]
        base = to_job_config(OmegaConf.create({"script": "t.py"}))
        return replace(base, **changes)

    assert rank_environment(job())[WARM_IMPORTS_VARIABLE] == "torch._dynamo,pytorch_lightning"  # a script: DDP, as most do
    assert rank_environment(job(script="pkg.train:main"))[WARM_IMPORTS_VARIABLE] == "torch._dynamo,hpc.hf"
    assert rank_environment(job(script="missing.py"))[WARM_IMPORTS_VARIABLE] == "torch._dynamo"
    loop = job(script=None)
    assert WARM_IMPORTS_VARIABLE not in rank_environment(loop)  # the built-in loop on the engine: the stand-in serves its optimizer
    for needs in (
        replace(loop, trainer=replace(loop.trainer, compile=True)),
        replace(loop, comm=replace(loop.comm, backend="gloo")),  # DistributedDataParallel
        replace(loop, comm=replace(loop.comm, backend="auto"), resources=replace(loop.resources, gpus_per_task=1)),  # NCCL
    ):
        assert rank_environment(needs)[WARM_IMPORTS_VARIABLE] == "torch._dynamo"
    cold = job()
    assert WARM_IMPORTS_VARIABLE not in rank_environment(replace(cold, cluster=replace(cold.cluster, warm_ranks=False)))
    told = job()
    told = replace(told, cluster=replace(told.cluster, env={WARM_IMPORTS_VARIABLE: ""}))
    assert rank_environment(told)[WARM_IMPORTS_VARIABLE] == ""  # cluster.env says otherwise: none
