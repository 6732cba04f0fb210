"""The trained model out of the toolkit: a run's checkpoint's model weights as a safetensors file.

    python -m trainers.export RUN_DIR --out model.safetensors [--step N | --best] [--state NAME]
    python -m trainers.export s3://bucket/prefix/RUN --out model.safetensors

RUN_DIR finds its checkpoints where the run put them (its checkpoints/, or the object store that
checkpoints/STORE names: checkpoint.uri); a URL is a run's place in an object store itself (the
endpoint and credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...). The checkpoint is the
newest committed one that verifies (its checksums), or the step asked for, or the one
checkpoint.best kept. Its model's state dict is written as safetensors (the
format of Hugging Face's `safetensors` package: an 8-byte header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes), with the task's description, the step and
the run's config in the header's metadata. Nothing is unpickled on the way (trainers.checkpoint.tensorfile).
A checkpoint of a script's run handle holds every registered object: the model is the one module
registered (or `--state NAME` among several). Loading it needs torch only: see `load` below, or
`safetensors.torch.load_file` where that package is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from collectives.fsdp import SHARDED
from trainers.checkpoint.checkpointer import CheckpointError, Committed, load_piece, load_tensor_file, verify
from trainers.checkpoint.layout import BEST, SHARED, parse_best, rank_file, rank_files, step_dir_name
from trainers.checkpoint.storage import CheckpointStore, StoreError, is_object_url, open_store, stored_checkpoints

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class ExportError(ValueError):
    """What cannot be exported, in one line naming why."""


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` (CPU or not) as one safetensors file, written under a temporary name and renamed."""
    header: dict[str, Any] = {"__metadata__": metadata}
    parts: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        if tensor.dtype not in DTYPES:
            raise ExportError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot hold")
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        parts.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensor bytes start 8-byte aligned
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for data in parts:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def load(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors and metadata, with torch alone (docs/checkpoints.md shows these lines)."""
    data = Path(path).read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    metadata = header.pop("__metadata__", {})
    dtypes = {code: dtype for dtype, code in DTYPES.items()}
    body = bytearray(data[8 + size :])
    tensors = {}
    for name, entry in header.items():
        dtype, (start, end) = dtypes[entry["dtype"]], entry["data_offsets"]
        if start == end:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        tensors[name] = torch.frombuffer(body, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start).reshape(entry["shape"]).clone()
    return tensors, metadata


def checkpoint_store(source: str, staging: Path) -> CheckpointStore:
    """The store a run dir, its checkpoints/ dir or a URL names (downloads go into `staging`)."""
    if is_object_url(source):
        return open_store(source, staging)
    path = Path(source.removeprefix("file://"))
    checkpoints = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not checkpoints.is_dir():
        raise ExportError(f"{path} is not a run dir (no checkpoints/ in it)")
    return stored_checkpoints(checkpoints)


def chosen_checkpoint(store: CheckpointStore, step: int | None, best: bool) -> Committed:
    try:
        if best:
            record = parse_best(store.read_meta(BEST))
            if record is None:
                raise ExportError(f"{store.url} keeps no best checkpoint (best.json: the run needs checkpoint.best=val_<figure>)")
            step = int(record["step"])
        kept = store.committed_steps()
    except StoreError as err:
        raise CheckpointError(str(err)) from None  # the store's trouble, not the input's: exit 1
    if step is not None:
        if step not in kept:
            raise ExportError(f"no checkpoint step {step} in {store.url} (it keeps steps {', '.join(map(str, kept)) or 'none'})")
        return verify(store, step)  # CheckpointError names a missing or corrupted file
    for newest in reversed(kept):
        try:
            return verify(store, newest)
        except CheckpointError as err:
            print(f"skipping {step_dir_name(newest)}: {err}", file=sys.stderr)
    raise ExportError(f"{store.url} holds no committed checkpoint")


def module_like(state: Any) -> bool:
    """A module's state dict: names to tensors, or to the markers a script's FSDP2 module leaves
    where each rank saved its rows (an optimizer's has `state` and `param_groups`)."""
    return isinstance(state, dict) and bool(state) and all(isinstance(k, str) and (isinstance(v, torch.Tensor) or is_marker(v)) for k, v in state.items())


def is_marker(value: Any) -> bool:
    return isinstance(value, dict) and SHARDED in value


def model_state(shared: dict[str, Any], name: str | None) -> tuple[str, dict[str, torch.Tensor]]:
    """The checkpoint's model weights and what they are called: the one registered module (the
    built-in loop's `model`, a script's), or `name` among several; a checkpoint of the built-in
    loop's layout before the registry holds one, `model`."""
    if "registry" not in shared and "handle" not in shared:
        if name not in (None, "model"):
            raise ExportError(f"--state {name}: a checkpoint of the built-in loop holds one model ('model')")
        return "model", dict(shared["model"])
    registered = shared.get("state", {})
    modules = sorted(key for key, value in registered.items() if module_like(value))
    if name is not None:
        if name not in registered:
            raise ExportError(f"--state {name}: the checkpoint registers {', '.join(map(repr, sorted(registered)))}")
        if not module_like(registered[name]):
            raise ExportError(f"--state {name}: that state holds no module weights (an optimizer's or a schedule's state)")
        return name, dict(registered[name])
    if len(modules) != 1:
        found = ", ".join(map(repr, modules)) or "none"
        raise ExportError(f"the checkpoint registers {len(modules)} modules ({found}): choose one with --state NAME")
    return modules[0], dict(registered[modules[0]])


RankStates = Callable[[], Iterator[dict[str, Any]]]  # every rank's own piece, read one at a time


def checkpoint_weights(ranks: Path | RankStates, shared: dict[str, Any], state: str | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """A committed checkpoint's model weights, whole: with comm.sharding=full, or a script's own
    fully_shard model under the run handle, consolidated from the rows every rank saved (`ranks`:
    a local checkpoint directory, or what reads its rank pieces)."""
    rank_states = ranks if callable(ranks) else lambda: (load_tensor_file(path) for path in rank_files(ranks))
    name, weights = model_state(shared, state)
    if shared.get("model_sharded"):
        shapes = {key: value for key, value in shared.get("model_shapes", {}).items() if key not in weights}
        weights = {**weights, **ranks_rows(rank_states, "model_shard", shapes)}
    markers: dict[str, Any] = {key: value for key, value in weights.items() if is_marker(value)}
    if markers:
        whole = ranks_rows(rank_states, "dtensor_pieces", {str(m[SHARDED]): m["shape"] for m in markers.values()})
        lacking = [key for key, m in markers.items() if str(m[SHARDED]) not in whole]
        if lacking:
            raise ExportError(f"no rank's file holds the rows of {', '.join(lacking[:3])}: the checkpoint is incomplete")
        weights = {key: whole[str(markers[key][SHARDED])] if key in markers else value for key, value in weights.items()}
    return name, weights


def ranks_rows(rank_states: RankStates, key: str, shapes: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Whole tensors of these shapes from the pieces every rank's file keeps under `key`, read one
    file at a time."""
    from collectives.fsdp import full_model_state

    return full_model_state((state.get(key, {"pieces": []}) for state in rank_states()), shapes)


def checkpoint_model(
    source: Path | str, step: int | None, best: bool, state: str | None = None
) -> tuple[Committed, dict[str, Any], str, dict[str, torch.Tensor]]:
    """The chosen committed checkpoint of a run dir or store URL (`source`), its shared piece,
    and its model's name and whole weights (export, and `python -m hpc.evaluate`)."""
    with tempfile.TemporaryDirectory(prefix="hpctk-export-") as staging:
        store = checkpoint_store(str(source), Path(staging))
        checkpoint = chosen_checkpoint(store, step, best)
        shared = load_piece(store, checkpoint, SHARED)
        name, weights = checkpoint_weights(lambda: (load_piece(store, checkpoint, rank_file(r)) for r in range(checkpoint.world_size)), shared, state)
    return checkpoint, shared, name, weights


def export(source: Path | str, out: Path, step: int | None = None, best: bool = False, state: str | None = None) -> dict[str, Any]:
    """Write the chosen checkpoint's model as safetensors; what was written (for the summary line)."""
    checkpoint, shared, name, weights = checkpoint_model(source, step, best, state)
    description = {key: value for key, value in shared.get("model_config", {}).items()}
    metadata = {
        "format": "pt",
        "hpctk_state": name,
        "hpctk_step": str(checkpoint.step),
        "hpctk_task": json.dumps(description, sort_keys=True, default=str),
        "hpctk_config": str(shared.get("config", "")),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, weights, metadata)
    count = sum(t.numel() for t in weights.values())
    return {"step": checkpoint.step, "state": name, "tensors": len(weights), "parameters": count, "task": description}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run dir (or its checkpoints/ dir), or a run's checkpoints in an object store (s3://...)")
    parser.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="this checkpoint step instead of the newest")
    which.add_argument("--best", action="store_true", help="the checkpoint checkpoint.best kept")
    parser.add_argument("--state", help="a script's registered module to export, where it registers several")
    args = parser.parse_args(argv)
    try:
        written = export(args.run_dir, args.out, args.step, args.best, args.state)
    except (ExportError, CheckpointError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ExportError) else 1  # what was asked for is not there (bad input), or what is there is damaged
    task = written["task"].get("task", "a script")
    print(f"{args.out}: {written['state']} of checkpoint step {written['step']} ({written['tensors']} tensors, {written['parameters']:,} values; task {task})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
