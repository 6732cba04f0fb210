"""An unwritable checkpoint directory is refused up front, also for root (CI runs as root).

Permission bits do not stop root, so as root the directory is made read-only with a read-only
bind mount in a private mount namespace (`unshare -m`): the kernel refuses the write with EROFS
whatever the user, and nothing outside the child process sees the mount. As another user,
`chmod 0o500` is enough. Either way the probe first proves that a plain write really fails, so
the test cannot pass on a directory that is in fact writable.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import require
from tests.support.runs import ROOT

PROBE = """
import json, sys
from pathlib import Path
from trainers.checkpoint.checkpointer import Checkpointer, CheckpointError
locked = Path(sys.argv[1])
result = {}
try:
    (locked / "probe").write_text("x")
    result["plain_write"] = "succeeded"
except OSError as err:
    result["plain_write"] = err.strerror
try:
    Checkpointer(locked, 0, 1, keep=2)
    result["checkpointer"] = "accepted"
except CheckpointError as err:
    result["checkpointer"] = str(err)
print(json.dumps(result))
"""


def probe_command(locked: Path) -> list[str]:
    """The probe, run where `locked` cannot be written by the user running it."""
    python = [sys.executable, "-c", PROBE, str(locked)]
    if os.geteuid() != 0:
        locked.chmod(0o500)
        return python
    require(shutil.which("unshare") is not None and shutil.which("mount") is not None, "unshare and mount (util-linux)")
    target = shlex.quote(str(locked))
    remount = f"mount --bind {target} {target} && mount -o remount,bind,ro {target} && exec {shlex.join(python)}"
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", remount]


def test_a_directory_nobody_may_write_is_refused_even_for_root(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run(probe_command(locked), capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    finally:
        locked.chmod(0o700)
    require(done.returncode == 0 or "mount" not in done.stderr, "a private mount namespace (CAP_SYS_ADMIN)")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["plain_write"] != "succeeded", "the directory was writable: the test would prove nothing"
    assert result["checkpointer"] == f"checkpoint dir {locked} is not writable"
    assert not (locked / "probe").exists() and list(locked.iterdir()) == []  # nothing leaked out of the namespace
