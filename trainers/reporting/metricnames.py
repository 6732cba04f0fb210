"""The names of a task's metric sums, agreed by every rank: the step's sums travel by position in
one allreduce, so a key that one rank reports and another does not (a per-class recall seen on
some ranks only, an auxiliary loss added at step 500) would pair the wrong numbers or give ranks
buffers of different lengths, which hangs. Here it ends the run on every rank at once, in one line
naming the key and the rank.

- `agree`: every rank's names exchanged (fixed-size collectives, never a hang); ranks that
  report none (an empty evaluation shard) take the others'.
- `fingerprint`: four numbers per step whose sums over the ranks equal world_size times one
  rank's exactly when every rank reports the same names (sum of h and of h squared: equal only if
  every h is equal), carried in the step's own allreduce; a mismatch then calls `agree`, which
  names it."""

from __future__ import annotations

import functools
import hashlib
import json

import torch

from collectives.base import Collectives
from trainers.task import TaskError

Names = tuple[str, ...]


@functools.lru_cache(maxsize=64)  # every step asks, for the same few tuples
def fingerprint(names: Names) -> tuple[float, ...]:
    """Two 20-bit hashes of the names and their squares: exact in float64 summed over up to
    2^13 ranks."""
    digest = hashlib.blake2b(json.dumps(list(names)).encode(), digest_size=8).digest()  # JSON: no two lists encode alike
    first, second = int.from_bytes(digest[:4], "little") % (1 << 20), int.from_bytes(digest[4:], "little") % (1 << 20)
    return (float(first), float(first) ** 2, float(second), float(second) ** 2)


def fingerprints_agree(summed: list[float] | tuple[float, ...], mine: Names, world_size: int) -> bool:
    return all(total == world_size * own for total, own in zip(summed, fingerprint(mine), strict=True))


def agree(comm: Collectives, names: Names | None, where: str) -> Names:
    """The names every rank reported (None: this rank has none to report, and takes the others');
    raises TaskError on every rank, naming the first key and rank that differ from the lowest
    rank's, if they are not all the same."""
    everyone = exchange(comm, names)
    reported = [(rank, n) for rank, n in enumerate(everyone) if n is not None]
    if not reported:
        return ()
    first_rank, first = reported[0]
    for rank, other in reported[1:]:
        if other != first:
            raise TaskError(mismatch_line(where, first_rank, first, rank, other))
    return first


def mismatch_line(where: str, rank_a: int, names_a: Names, rank_b: int, names_b: Names) -> str:
    extra = [n for n in names_b if n not in names_a]
    missing = [n for n in names_a if n not in names_b]
    if extra:
        what = f"rank {rank_b} reports {extra[0]!r}, which rank {rank_a} does not"
    elif missing:
        what = f"rank {rank_a} reports {missing[0]!r}, which rank {rank_b} does not"
    else:
        what = f"ranks {rank_a} and {rank_b} report them in another order"
    return (
        f"the metric names differ across ranks at {where}: {what}; every rank must report the same keys in StepOutput.sums "
        "(report 0.0 where a metric does not apply)"
    )


def changed_line(step: int, first: Names, now: Names) -> str:
    """The one line when every rank's names changed alike after the first step."""
    extra = [n for n in now if n not in first]
    what = f"every rank reports {extra[0]!r}, which the first step did not" if extra else f"no rank reports {next(n for n in first if n not in now)!r} any more"
    return f"the metric names changed at step {step}: {what}; report every metric from the first step on (0.0 where it does not apply yet)"


def exchange(comm: Collectives, names: Names | None) -> list[Names | None]:
    """Every rank's names, in rank order, through two fixed-size collectives: the longest
    encoding (max), then every rank's padded to it (allgather)."""
    encoded = json.dumps(list(names)).encode() if names is not None else b""
    size = torch.tensor([float(len(encoded) + 1)], dtype=torch.float64)  # + 1: a header, -1 for "none"
    comm.allreduce_(size, op="max")
    slot = torch.zeros(int(size.item()), dtype=torch.int32)
    slot[0] = -1 if names is None else len(encoded)
    slot[1 : 1 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.int32)
    gathered = comm.allgather(slot).reshape(comm.world_size, -1).tolist()
    return [None if row[0] < 0 else tuple(json.loads(bytes(row[1 : 1 + row[0]]).decode())) for row in gathered]
