"""What tests/unit/test_warm.py runs as a fork of a warm process (hpc.rank.warm): it says where it
runs, then does what PROBE says: exit with CODE (or os._exit), wait for SIGUSR1, raise, park, or sleep."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from hpc.rank.warm import forked_line

got: list[int] = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))  # before the line below: the test signals after it
# the unseeded streams, where the warm process imported them: each rank's own, as a new interpreter's
draws = {}
if "numpy" in sys.modules:
    draws["numpy"] = float(sys.modules["numpy"].random.random())
if "torch" in sys.modules:
    draws["torch"] = float(sys.modules["torch"].rand(1))
had = {name: name in sys.modules for name in os.environ.get("PROBE_MODULES", "").split(",") if name}  # imported before the fork
dynamo = type(sys.modules["torch._dynamo"]).__name__ if "torch._dynamo" in sys.modules else None  # StandIn: hpc.rank.dynamo's
said = {"pid": os.getpid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("PROBE_X"), "forked": forked_line(), "draws": draws, "had": had}
said["dynamo"] = dynamo
print(json.dumps(said), flush=True)
print("to stderr", file=sys.stderr, flush=True)
mode = os.environ.get("PROBE", "exit")
if mode == "exit":
    sys.exit(int(os.environ.get("PROBE_CODE", "0")))
if mode == "usr1":
    while not got:
        time.sleep(0.01)
    sys.exit(40 + got[0])
if mode == "os_exit":  # as the watchdog ends a rank: no interpreter exit, nothing said to the client
    os._exit(int(os.environ.get("PROBE_CODE", "0")))
if mode == "forks":  # a child of the rank that comes back up through runpy must not speak for it
    if os.fork() == 0:
        sys.exit(0)
    os.wait()
    sys.exit(int(os.environ.get("PROBE_CODE", "0")))
if mode == "leaves_child":  # a process the rank started and did not end
    import subprocess

    print(subprocess.Popen(["sleep", "300"]).pid, flush=True)
    sys.exit(0)
if mode in ("park", "stuck"):  # a rank that may park (hpc.rank.parking) once its client is gone; "stuck" never unwinds
    from hpc.rank import parking

    while mode == "stuck" and not got:  # arms on SIGUSR1: the test decides when its word is sent
        time.sleep(0.01)

    print(json.dumps({"armed": parking.arm(os.environ.get(parking.SLOT_VARIABLE))}), flush=True)
    while mode == "park" and not parking.parking():
        time.sleep(0.01)
    if mode == "park":
        parking.raise_if_parking()  # where the rank's training would report its failure
if mode == "raise":
    raise RuntimeError("the probe's own error")
time.sleep(300)
