"""A checkpoint's save to an object store against the same save to local disk, in one run.

    python benchmarks/checkpoint_store.py [--mb 256] [--repeats 3] [--url s3://hpctk-tests/bench]

Each save is a training run's, through trainers.checkpoint.checkpointer.Checkpointer over trainers/checkpoint/storage.py:
the state written to the staging directory by trainers.checkpoint.tensorfile (fsynced, with its checksum
file), put into the store, the marker committed last, the previous step pruned. Two figures per
store: a synchronous save (the final or on-signal save: the training thread waits for all of
it), and what an asynchronous (periodic) save costs the training thread (the host copy; the
writing and uploading go on beside training) with the time until it is committed. Local: the
staging dir is the store's own (`LocalStore`: nothing to upload, a rename and fsyncs). S3: the
same file uploaded to the URL (`ObjectStore`; the endpoint and credentials from
AWS_ENDPOINT_URL and the other standard variables: `eval $(scripts/s3-sim.sh env)` for the
S3-compatible server scripts/s3-sim.sh starts here). Interleaved repeats, medians; the ratio is
S3 time / local time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainers.checkpoint.checkpointer import Checkpointer
    from trainers.checkpoint.storage import CheckpointStore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def save_once(checkpointer: Checkpointer, step: int, state: dict[str, Any], asynchronous: bool) -> tuple[float, float]:
    """(seconds the training thread is held, seconds until committed) for one save of `state`."""
    import torch

    began = time.perf_counter()
    checkpointer.begin_save(step, state, {"rng": torch.zeros(1)}, asynchronous)
    held = time.perf_counter() - began
    checkpointer.wait_written()
    checkpointer.commit()
    checkpointer.wait_pruned()
    return held, time.perf_counter() - began


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/checkpoint_store.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB (float32 tensors of 16 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--url", default="s3://hpctk-tests/bench", help="the object store's URL (a fresh prefix under it per run)")
    args = parser.parse_args(argv)

    import torch

    from trainers.checkpoint.checkpointer import Checkpointer
    from trainers.checkpoint.storage import LocalStore, ObjectStore

    state = {f"t{i}": torch.randn(4 << 20) for i in range(max(1, args.mb // 16))}
    mib = sum(t.numel() * 4 for t in state.values()) / 2**20
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {(kind, mode): [] for kind in ("local", "s3") for mode in (False, True)}
    with tempfile.TemporaryDirectory(dir=ROOT) as scratch:
        stores: dict[str, CheckpointStore] = {
            "local": LocalStore(Path(scratch) / "checkpoints"),
            "s3": ObjectStore(f"{args.url.rstrip('/')}/{uuid.uuid4().hex}", Path(scratch) / "staging"),
        }
        checkpointers = {kind: Checkpointer(store, 0, 1, keep=2) for kind, store in stores.items()}
        step = 0
        for repeat in range(args.repeats):
            for kind in ["local", "s3"] if repeat % 2 == 0 else ["s3", "local"]:
                for asynchronous in (False, True):
                    step += 1
                    times[kind, asynchronous].append(save_once(checkpointers[kind], step, state, asynchronous))
        for store in stores.values():
            for kept in store.committed_steps():
                store.remove(kept)

    def median(kind: str, asynchronous: bool, which: int) -> float:
        return statistics.median(t[which] for t in times[kind, asynchronous])

    print(f"checkpoint of {mib:.0f} MiB through the Checkpointer, median of {args.repeats} interleaved saves each")
    print("| store | synchronous save s | MiB/s | async: training thread held s | async: committed after s |\n| --- | --- | --- | --- | --- |")
    for kind, name in (("local", "local disk"), ("s3", args.url)):
        sync_s = median(kind, False, 1)
        print(f"| {name} | {sync_s:.2f} | {mib / sync_s:.0f} | {median(kind, True, 0):.2f} | {median(kind, True, 1):.2f} |")
    print(f"S3 / local: {median('s3', False, 1) / median('local', False, 1):.2f}x the time of a synchronous save")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
