"""The toolkit's GPU path and 16-core scaling, checked in one short call on a lent GPU machine.

    benchmarks/device/wheels.sh                       # here, once: the wheels the GPU machine lacks
    python3 -m benchmarks.device --out "$OUT"         # there: every check, in order of value
    python3 -m benchmarks.device --mode cpu --out D   # anywhere: the same checks, tiny, on CPUs (CI)

Each check runs in a process of its own with its own time budget (a slow one is killed with
all its processes and cannot eat the others), and the summary (summary.json + summary.md under --out) is rewritten
after every check, so whatever finished is reported even if the whole command is killed.
"""
