"""The Slurm plugin's login-side settings: its traits (what the login node's checks ask of it),
and any sbatch option, from the command line (`+cluster.sbatch.mail-type=END`) or a cluster's
YAML: `cluster.sbatch` maps sbatch's long option names to values, rendered as `#SBATCH --name=value`
lines (submitit quotes each value) or `#SBATCH --name` for `true`. The options the toolkit sets
itself are refused there, naming the setting that owns them: a second `--signal` or `--array`
line would silently override what the stop, requeue and sweep machinery relies on. Checked on
the login node through the plugin's launcher (SlurmLauncher.check), for Slurm jobs alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hpc.config.launchers import LauncherTraits
from hpc.config.scriptvalues import has_control_character, job_ids
from hpc.errors import UserError

TRAITS = LauncherTraits(  # the plugin's (hpc.schedulers.BUILT_IN)
    "slurm",
    "Slurm",
    queued=True,
    one_machine=False,
    asks_for_gpus=True,
    tool="sbatch",
    without_tool="sbatch not found: cluster={cluster} needs a Slurm login node; use cluster=local to run here",
)

# sbatch's own long options (Slurm 22.05 to 24.11; `sbatch --help` lists most, the rest are in its
# man page). tests/e2e checks this set against the installed sbatch's --help.
KNOWN = frozenset(
    """
    account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment constraint
    container container-id contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task
    deadline delay-boot dependency distribution error exclude exclusive export export-file
    extra-node-info get-user-env gid gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task
    gres gres-flags hint hold ignore-pbs input job-name kill-on-invalid-dep licenses mail-type mail-user
    mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus network nice no-kill no-requeue nodefile
    nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket open-mode
    output overcommit oversubscribe parsable partition power prefer priority profile propagate qos
    quiet reboot requeue reservation segment signal sockets-per-node spread-job switches test-only
    thread-spec threads-per-core time time-min tmp tres-bind tres-per-task uid use-min-nodes wait
    wckey wrap
    """.split()
)

# The options the toolkit sets, and the setting to use instead.
OWNED = {
    "signal": "cluster.signal and cluster.signal_seconds",
    "requeue": "cluster.requeue",
    "no-requeue": "cluster.requeue=false",
    "array": "a sweep (launch.py -m) and sweep.max_parallel",
    "output": "the toolkit (each job's output goes to <run_dir>/slurm/)",
    "error": "the toolkit (each job's output goes to <run_dir>/slurm/)",
    "input": "the toolkit (a job reads no stdin)",
    "job-name": "name",
    "nodes": "resources.nodes (and resources.spare_nodes)",
    "ntasks": "resources.nodes x resources.tasks_per_node",
    "ntasks-per-node": "resources.tasks_per_node",
    "cpus-per-task": "resources.cpus_per_task",
    "gpus-per-task": "resources.gpus_per_task",
    "time": "resources.time_min (or cluster.time_min)",
    "partition": "cluster.partition",
    "account": "cluster.account",
    "qos": "cluster.qos",
    "constraint": "cluster.constraint",
    "mem": "cluster.mem_gb",
    "switches": "cluster.switches and cluster.switches_wait_min",
    "hold": "hold=true",
    "no-kill": "resources.spare_nodes",
    "export": "cluster.env (every job script exports it to the ranks)",
    "chdir": "the toolkit (a job runs in its run dir's code)",
    "wrap": "the toolkit (it writes the job script)",
    "parsable": "the toolkit (it reads sbatch's answer)",
    "wait": "the toolkit (launch.py follows the job itself)",
    "test-only": "dry_run=true",
    "dependency": "after= (afterok) and after_any= (afterany)",
}

OPTION_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")


def sbatch_lines(options: Mapping[str, Any]) -> dict[str, Any]:
    """`cluster.sbatch` as submitit's additional_parameters: `true` a flag, `false` and null left
    out, other values as text. UserError for a name sbatch does not know, an option the toolkit
    owns, a value that is not one value, or a control character (a line break would end the
    quoted value and start a line the shell runs)."""
    rendered: dict[str, Any] = {}
    for name, value in options.items():
        key = str(name)
        if not OPTION_NAME.fullmatch(key):
            raise UserError(f"cluster.sbatch.{key}: name sbatch's long option without dashes, e.g. cluster.sbatch.mail-type=END")
        if key in OWNED:
            raise UserError(f"cluster.sbatch.{key}: the toolkit sets --{key} itself; use {OWNED[key]}")
        if key not in KNOWN:
            near = sorted(known for known in KNOWN if known.startswith(key[:3]))
            hint = f" (sbatch has {', '.join('--' + n for n in near[:4])})" if near else ""
            raise UserError(f"cluster.sbatch.{key}: sbatch has no option --{key}{hint}")
        if value is None or value is False:
            continue
        if not isinstance(value, str | int | float | bool):
            raise UserError(f"cluster.sbatch.{key}={value!r}: give one value (a list or mapping is no sbatch option's)")
        text = value if isinstance(value, bool) else str(value)
        if isinstance(text, str) and has_control_character(text):
            raise UserError(f"cluster.sbatch.{key}={text!r} contains a control character (line break, tab, ...); use printable characters only")
        rendered[key] = text
    return rendered


def dependency(after: Any, after_any: Any) -> str | None:
    """sbatch's --dependency for `after` (afterok: each ended COMPLETED) and `after_any`
    (afterany: each ended, in any state); None: neither."""
    parts = [
        f"{kind}:{':'.join(ids)}" for kind, ids in (("afterok", job_ids("after", after, TRAITS)), ("afterany", job_ids("after_any", after_any, TRAITS))) if ids
    ]
    return ",".join(parts) or None
