"""auto's choice by measurement: every allreduce algorithm timed on the job's own ranks at a ladder
of sizes, once per host type, world size and node shape, then cached.

Crossovers are properties of a machine, a world size and a day: constants measured elsewhere
lost to MPI_Allreduce at 1-4 MiB on one machine and to the hierarchical allreduce at 4-16 MiB on
another. NCCL picks its algorithm from a model of the machine and Horovod autotunes its fusion
settings during the run; we time the candidates on the ranks that will use them (under a
second on 2 ranks) and keep the table, so later jobs of the same shape start without it.

Every rank must choose the same algorithm for every call, or the job deadlocks: the table holds
the slowest rank's time (an allreduce of MAX), it is read by rank 0 alone and broadcast, and the
choice is a pure function of the table.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from collectives.bench_report import human
from collectives.mpirun import HUGE_PAGES

log = logging.getLogger("collectives")

FORMAT = 2  # bump when an algorithm or the way it is timed changes: older tables no longer describe it
TUNED_SIZES = tuple(1 << k for k in range(10, 27, 2))  # bytes per rank: 1 KiB, 4 KiB ... 64 MiB


def default_cache_dir() -> str:
    """$HPCTK_CACHE, else $XDG_CACHE_HOME/hpc-toolkit, else ~/.cache/hpc-toolkit; then
    allreduce/. On a cluster, home is shared: the key keeps host types apart."""
    root = os.environ.get("HPCTK_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "hpc-toolkit")
    return os.path.join(os.path.expanduser(root), "allreduce")


class TuningError(ValueError):
    """A cached table that does not describe this job (wrong shape, edited, truncated)."""


@dataclass(frozen=True)
class TuningTable:
    key: str
    sizes: tuple[int, ...]
    seconds: dict[str, tuple[float, ...]]  # per algorithm: the slowest rank's median, per size
    tuned_in_s: float = 0.0

    def estimate(self, algorithm: str, nbytes: int) -> float:
        """Seconds for an allreduce of `nbytes` per rank: log-log interpolation between tuned
        sizes; below the smallest its time, above the largest proportional to the bytes."""
        sizes, times = self.sizes, self.seconds[algorithm]
        if nbytes <= sizes[0]:
            return times[0]
        if nbytes >= sizes[-1]:
            return times[-1] * nbytes / sizes[-1]
        i = bisect.bisect_right(sizes, nbytes) - 1
        share = math.log(nbytes / sizes[i]) / math.log(sizes[i + 1] / sizes[i])
        return math.exp(math.log(times[i]) + share * (math.log(times[i + 1]) - math.log(times[i])))

    def fastest(self, nbytes: int, eligible: Iterable[str]) -> str | None:
        """The eligible algorithm with the least estimated time; ties go to the first eligible."""
        candidates = [name for name in eligible if name in self.seconds]
        if not candidates:
            return None
        return min(candidates, key=lambda name: self.estimate(name, nbytes))

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "key": self.key, "sizes": list(self.sizes), "seconds": self.seconds, "tuned_in_s": self.tuned_in_s}, indent=1)

    @classmethod
    def from_json(cls, text: str, key: str) -> TuningTable:
        try:
            data = json.loads(text)
            sizes = tuple(int(s) for s in data["sizes"])
            seconds = {str(name): tuple(float(t) for t in times) for name, times in data["seconds"].items()}
            table = cls(str(data["key"]), sizes, seconds, float(data.get("tuned_in_s", 0.0)))
            fmt = data["format"]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise TuningError(f"not a tuning table ({err})") from None
        if fmt != FORMAT or table.key != key:
            raise TuningError("tuned for another job shape or an older engine")
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise TuningError("sizes must be positive and increasing")
        if not seconds or any(len(t) != len(sizes) or not all(x > 0 and math.isfinite(x) for x in t) for t in seconds.values()):
            raise TuningError("every algorithm needs one positive time per size")
        return table


def host_type() -> str:
    """What makes one machine time collectives like another: CPU model and core count, and
    whether torch puts large tensors on huge pages (collectives.mpirun.huge_pages_environment:
    15-25% at 16-64 MiB here)."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    huge_pages = " thp" if os.environ.get(HUGE_PAGES) == "1" else ""  # torch's own reading: "1" on, anything else off
    return f"{model} x{os.cpu_count()}{huge_pages}"


def tuning_key(host: str, world_size: int, node_sizes: tuple[int, ...], mpi_library: str, candidates: Iterable[str]) -> str:
    """One table per host type, world size, node shape (ranks on each node), MPI library and
    candidate set; readable, so that a cache directory can be browsed."""
    shape = "x".join(str(n) for n in node_sizes) or "flat"
    return f"v{FORMAT} | {host} | {world_size} ranks | nodes {shape} | {mpi_library} | {','.join(sorted(candidates))}"


def cache_file(cache_dir: str, key: str) -> Path:
    return Path(cache_dir).expanduser() / f"allreduce-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def read_table(path: Path, key: str) -> TuningTable | None:
    """The table in `path` if it was tuned for `key`; None when there is none or it cannot be
    used (warned: an unreadable or edited file is measured again, never trusted)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("allreduce tuning table %s unreadable (%s): measuring again", path, err)
        return None
    try:
        return TuningTable.from_json(text, key)
    except TuningError as err:
        log.warning("allreduce tuning table %s not used: %s", path, err)
        return None


def write_table(path: Path, table: TuningTable) -> bool:
    """Atomically (a job beside this one may read it now); a read-only home only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".allreduce-", suffix=".tmp", delete=False) as tmp:
            tmp.write(table.to_json() + "\n")
        os.replace(tmp.name, path)
    except OSError as err:
        log.warning("allreduce tuning table not written to %s (%s)", path, err)
        return False
    return True


def iterations_for(nbytes: int) -> int:
    """Timed calls per block (two blocks per candidate and size): more where a scheduler tick
    can swamp a single call."""
    return 8 if nbytes <= 1 << 20 else 6 if nbytes <= 16 << 20 else 3


def measure_table(
    comm: Any, run: Callable[[torch.Tensor, str], None], candidates: list[str], key: str, sizes: tuple[int, ...] = TUNED_SIZES, rounds: int = 2, warmup: int = 1
) -> TuningTable:
    """Collective: time `run(buffer, algorithm)` for every candidate at every size; the slowest
    rank's median. Each candidate runs in blocks of back-to-back calls (the steady state of a
    training loop, which repeats the same bucket sizes), the first `warmup` of them untimed, in
    `rounds` rounds of alternating order, so that drift on a shared machine hits every candidate alike.
    Four rounds with two untimed calls cost 2.5x the time and chose no more consistently in two
    sessions of benchmarks/tuning_stability.py (7 of 8 against 5 of 8, then 3-4 of 8 against
    5 of 8): below the noise between launches, more samples do not settle a choice."""
    from mpi4py import MPI

    started = time.perf_counter()
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for nbytes in sizes:
        source = torch.full((nbytes // 4,), float(comm.Get_rank() + 1))
        buffer = source.clone()
        samples: dict[str, list[float]] = {name: [] for name in candidates}
        for round_ in range(rounds):
            for name in candidates if round_ % 2 == 0 else candidates[::-1]:
                for call in range(warmup + iterations_for(nbytes)):
                    buffer.copy_(source)
                    comm.Barrier()
                    begin = time.perf_counter()
                    run(buffer, name)
                    if call >= warmup:
                        samples[name].append(time.perf_counter() - begin)
        slowest = torch.tensor([max(statistics.median(samples[name]), 1e-9) for name in candidates], dtype=torch.float64)
        comm.Allreduce(MPI.IN_PLACE, slowest.numpy(), op=MPI.MAX)
        for name, value in zip(candidates, slowest.tolist(), strict=True):
            seconds[name].append(value)
    elapsed = comm.allreduce(time.perf_counter() - started, op=MPI.MAX)
    return TuningTable(key, tuple(sizes), {name: tuple(times) for name, times in seconds.items()}, round(elapsed, 3))


def describe(table: TuningTable, sizes: Iterable[int], eligible: list[str]) -> str:
    """'1 KiB mpi, 1 MiB rhd, 16 MiB ring': auto's choice at each of `sizes`, for the log."""
    return ", ".join(f"{human(n)} {table.fastest(n, eligible)}" for n in sizes)
