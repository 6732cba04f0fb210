"""A checkpoint's save to an object store against the same save to local disk, in one run.

    python benchmarks/checkpoint_store.py [--mb 256] [--repeats 3] [--url s3://hpctk-tests/bench]

Each save goes through trainers/storage.py as a checkpoint's does: the state written to the
staging directory by trainers.tensorfile (fsynced), put into the store, the marker committed
last. Local: the staging dir is the store's own (`LocalStore`: nothing to upload, a rename and
fsyncs). S3: the same file uploaded to the URL (`ObjectStore`; the endpoint and credentials from
AWS_ENDPOINT_URL and the other standard variables: `eval $(scripts/s3-sim.sh env)` for the
S3-compatible server scripts/s3-sim.sh starts here). Interleaved repeats, medians; the ratio is
S3 time / local time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainers.storage import CheckpointStore

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def save_once(store: CheckpointStore, staging: Path, step: int, state: dict[str, Any]) -> float:
    """Seconds for one save of `state` as a checkpoint of `step` into `store`."""
    from trainers.layout import SHARED
    from trainers.tensorfile import write_tensor_file

    began = time.perf_counter()
    piece = staging / f".tmp-step-{step:09d}" / SHARED
    piece.parent.mkdir(parents=True, exist_ok=True)
    nbytes, sha256 = write_tensor_file(piece, state)
    store.put(step, SHARED, piece)
    store.commit(step, json.dumps({"step": step, "files": {SHARED: {"bytes": nbytes, "sha256": sha256}}}).encode())
    return time.perf_counter() - began


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/checkpoint_store.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256, help="state size in MiB (float32 tensors of 16 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--url", default="s3://hpctk-tests/bench", help="the object store's URL (a fresh prefix under it per run)")
    args = parser.parse_args(argv)

    import torch

    from trainers.storage import LocalStore, ObjectStore

    state = {f"t{i}": torch.randn(4 << 20) for i in range(max(1, args.mb // 16))}
    mib = sum(t.numel() * 4 for t in state.values()) / 2**20
    times: dict[str, list[float]] = {"local": [], "s3": []}
    with tempfile.TemporaryDirectory(dir=ROOT) as scratch:
        local = LocalStore(Path(scratch) / "checkpoints")
        local.root.mkdir()
        remote = ObjectStore(f"{args.url.rstrip('/')}/{uuid.uuid4().hex}", Path(scratch) / "staging")
        for repeat in range(args.repeats):
            order = ["local", "s3"] if repeat % 2 == 0 else ["s3", "local"]
            for kind in order:
                store: CheckpointStore = local if kind == "local" else remote
                staging = local.root if kind == "local" else remote.staging_root
                times[kind].append(save_once(store, staging, repeat + 1, state))
                store.remove(repeat + 1)
    local_s, s3_s = statistics.median(times["local"]), statistics.median(times["s3"])
    print(f"checkpoint of {mib:.0f} MiB, median of {args.repeats} interleaved saves each")
    print("| store | save s | MiB/s |\n| --- | --- | --- |")
    print(f"| local disk | {local_s:.2f} | {mib / local_s:.0f} |\n| {args.url} | {s3_s:.2f} | {mib / s3_s:.0f} |")
    print(f"S3 / local: {s3_s / local_s:.2f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
