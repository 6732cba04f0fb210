"""hpc.proctree: a process tree read from /proc and ended at once, with children in process
groups of their own (as mpirun starts its ranks), which a signal to the root's group misses."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from hpc.proctree import children, descendants, kill_tree, parents, session_members

# A root whose two children lead process groups of their own, one with a child of its own; all sleep.
TREE = """
import subprocess, sys, time
grandchild = "import subprocess; subprocess.run(['sleep', '60'])"
for code in ("import time; time.sleep(60)", grandchild):
    subprocess.Popen([sys.executable, "-c", code], process_group=0)
time.sleep(60)
"""


def running(pid: int) -> bool:
    """Neither gone nor a zombie (one whose parent has not reaped it yet has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_parents_reads_the_parent_after_a_command_name_with_spaces_and_parentheses(tmp_path):
    for pid, stat in {"7": "7 (a) b) S 1 7 7", "9": "9 (mpirun) S 7 9 9", "11": "11 (x) S 9 11 9", "12": "12 (y) S 1 12 9", "self": "0 (y) S 3"}.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "stat").write_text(stat)
    (tmp_path / "13").mkdir()  # ended between the listing and the read: no stat
    assert parents(tmp_path) == {7: 1, 9: 7, 11: 9, 12: 1}
    assert children(7, tmp_path) == [9] and descendants(7, tmp_path) == [9, 11] and descendants(11, tmp_path) == []
    assert session_members(9, tmp_path) == [9, 11, 12]  # 12: reparented to init, still in mpirun's session
    assert parents(tmp_path / "absent") == {}


def test_kill_tree_ends_children_in_groups_of_their_own_and_theirs():
    root = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        deadline = time.monotonic() + 30
        while len(descendants(root.pid)) < 3 and time.monotonic() < deadline:  # two children and the second one's sleep
            time.sleep(0.05)  # polled: the tree builds itself
        tree = descendants(root.pid)
        assert len(tree) == 3 and all(running(pid) for pid in tree), tree
        kill_tree(root.pid)
        root.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.05)  # polled: init reaps the orphans in its own time
        assert not any(running(pid) for pid in tree), [pid for pid in tree if running(pid)]
    finally:
        if root.poll() is None:  # never a reaped pid: another process may have it now
            kill_tree(root.pid)
        root.wait()
