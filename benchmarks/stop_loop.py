"""Stop a local run again and again and count the launches that hang after a clean stop.

    python benchmarks/stop_loop.py [--stops 200] [--ranks 2] [--hang-after 60] [--write docs/reliability.md]

One run dir: `python launch.py` makes it, then each round starts its command.txt (hpc.launching.ranks
under mpirun, as a user resuming it would), waits for two more logged steps, sends SIGTERM to
the launcher (forwarded to the ranks, as a Ctrl-C is) and waits for the launcher to exit. A
launcher still running `--hang-after` seconds after the signal is a hang: it is killed and
counted. Reported: stops, hangs, exit codes, seconds from the signal to the launcher's exit.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as `python benchmarks/stop_loop.py`

from benchmarks.rundirs import logged_steps  # noqa: E402  (after the path)
from hpc.proctree import kill_tree  # noqa: E402


def one_stop(command: list[str], env: dict[str, str], run_dir: Path, hang_after_s: float) -> tuple[int | None, float]:
    """(the launcher's exit code, or None for a hang; seconds from the signal to its exit)."""
    start = logged_steps(run_dir)
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while logged_steps(run_dir) < start + 2:
        if launcher.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the run ended or stalled before the signal (exit {launcher.poll()}); see {run_dir}/logs")
        time.sleep(0.01)  # polling the step log: there is no event to wait on
    signalled = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    try:
        code: int | None = launcher.wait(timeout=hang_after_s)
    except subprocess.TimeoutExpired:
        kill_tree(launcher.pid)  # mpirun and the ranks too: a session of their own, each rank a group
        launcher.wait()
        code = None
    return code, time.monotonic() - signalled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stops", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hang-after", type=float, default=60.0, help="seconds after the signal that count as a hang")
    parser.add_argument("--write", type=Path, help="append the figures to this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = [f"resources.tasks_per_node={args.ranks}", "trainer.max_steps=1", "checkpoint.every_minutes=null", f"run_root={tmp}/runs"]
        made = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), *job],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        if made.returncode != 0:
            raise SystemExit(f"launch.py failed: {made.stderr[-2000:]}")
        (run_dir,) = [p.parent for p in Path(tmp, "runs").glob("*/*/config.yaml")]
        config = run_dir / "config.yaml"
        config.write_text(config.read_text().replace("max_steps: 1", "max_steps: null").replace("epochs: 20", "epochs: 100000"))
        command = shlex.split((run_dir / "command.txt").read_text())
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        codes: collections.Counter[str] = collections.Counter()
        seconds = []
        for _ in range(args.stops):
            code, took = one_stop(command, env, run_dir, args.hang_after)
            codes["hang" if code is None else str(code)] += 1
            seconds.append(took)
    hangs = codes.get("hang", 0)
    text = (
        f"- {args.stops} stops of a {args.ranks}-rank local run (SIGTERM to the command.txt launcher after 2 steps): "
        f"{hangs} hangs (launcher alive {args.hang_after:g} s after the signal); exit codes "
        + ", ".join(f"{code}: {n}" for code, n in sorted(codes.items()))
        + f"; signal to exit median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s"
    )
    print(text)
    if args.write:
        with args.write.open("a") as f:
            f.write(
                f"\n### Stops without a hang ({date.today().isoformat()}, {platform.node()}, {os.cpu_count()} cores)\n\n"
                f"`python benchmarks/stop_loop.py --stops {args.stops} --ranks {args.ranks}`\n\n{text}\n"
            )


if __name__ == "__main__":
    main()
