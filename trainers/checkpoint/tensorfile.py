"""A checkpoint file format that is fast to write and cannot run code when read.

    magic "HPCTENS1" | u64 header length | header | zero padding to 4 KiB | tensor bytes...

The header is a `torch.save` of the object with every tensor replaced by a reference, plus a
table (dtype, shape, offset, bytes) of the tensors; it holds only plain containers, numbers and
strings and is read with `torch.load(weights_only=True)`. Tensor bytes are written straight from
the tensors' memory: no serialization copy. The sha256 of the whole file is computed from the
same memory on a second thread while the writer thread writes and fsyncs, so a save costs about
max(write, hash) instead of serialize + hash + write.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

MAGIC = b"HPCTENS1"
ALIGN = 4096
CHUNK = 16 << 20  # bytes handed to write() at once
_REF = "__hpc_tensor__"


class TensorFileError(ValueError):
    """A file that is not a well-formed tensor file; the message names what is wrong."""


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The object with tensors replaced by {_REF: index}; the tensors, as contiguous CPU bytes."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach().cpu().contiguous())
        return {_REF: len(tensors) - 1}
    if isinstance(obj, dict):
        return {key: _split(value, tensors) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_split(value, tensors) for value in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_REF}:
            return tensors[obj[_REF]]
        return {key: _join(value, tensors) for key, value in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_join(value, tensors) for value in obj)
    return obj


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _chunks(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), CHUNK):
        yield view[start : start + CHUNK]


def _layout(skeleton: Any, tensors: list[torch.Tensor]) -> tuple[bytes, list[int]]:
    """(everything before the first tensor byte, each tensor's offset from the data start)."""
    table: list[dict[str, Any]] = []
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        table.append({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "offset": offset, "bytes": nbytes})
        offset += nbytes
    buffer = io.BytesIO()
    torch.save({"object": skeleton, "tensors": table}, buffer)
    header = buffer.getvalue()
    prefix = MAGIC + struct.pack("<Q", len(header)) + header
    return prefix + b"\0" * (-len(prefix) % ALIGN), [entry["offset"] for entry in table]


def write_tensor_file(path: Path, obj: Any) -> tuple[int, str]:
    """Write `obj` to `path` and fsync it; returns (bytes written, sha256 of the file)."""
    tensors: list[torch.Tensor] = []
    prefix, _ = _layout(_split(obj, tensors), tensors)
    views = [_bytes_of(t) for t in tensors]
    digest = hashlib.sha256(prefix)
    hash_error: list[BaseException] = []

    def hash_all() -> None:  # hashlib releases the GIL on large buffers: this runs beside write()
        try:
            for view in views:
                for chunk in _chunks(view):
                    digest.update(chunk)
        except BaseException as err:  # re-raised below
            hash_error.append(err)

    hasher = threading.Thread(target=hash_all, name="checkpoint-hash", daemon=True)
    hasher.start()
    try:
        with path.open("wb", buffering=0) as f:
            f.write(prefix)
            for view in views:
                for chunk in _chunks(view):
                    f.write(chunk)
            os.fsync(f.fileno())
    finally:
        hasher.join()
    if hash_error:
        raise hash_error[0]
    return len(prefix) + sum(len(v) for v in views), digest.hexdigest()


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise TensorFileError(f"unknown dtype {name!r}")
    return dtype


def read_tensor_file(path: Path) -> Any:
    """The object written by write_tensor_file. Nothing in the file can run code; a truncated
    or malformed file raises TensorFileError (pickled objects: pickle.UnpicklingError)."""
    with path.open("rb") as f:
        return _read_tensors(f, path.stat().st_size)


def read_tensor_bytes(data: bytes | memoryview) -> Any:
    """The object of a tensor file's bytes (a copy held in memory), as read_tensor_file reads it."""
    return _read_tensors(io.BytesIO(data), len(data))


def _read_tensors(f: io.BufferedIOBase | io.BytesIO, size: int) -> Any:
    magic, length_bytes = f.read(len(MAGIC)), f.read(8)
    if magic != MAGIC or len(length_bytes) != 8:
        raise TensorFileError("not a checkpoint tensor file (bad magic)")
    (length,) = struct.unpack("<Q", length_bytes)
    if length > size:
        raise TensorFileError("header longer than the file (truncated)")
    header = torch.load(io.BytesIO(f.read(length)), map_location="cpu", weights_only=True)
    if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
        raise TensorFileError("malformed header")
    data_start = len(MAGIC) + 8 + length
    data_start += -data_start % ALIGN
    tensors = []
    for entry in header["tensors"]:
        dtype, shape, offset, nbytes = _dtype(entry["dtype"]), [int(n) for n in entry["shape"]], int(entry["offset"]), int(entry["bytes"])
        numel = 1
        for n in shape:
            numel *= n
        if nbytes != numel * torch.empty((), dtype=dtype).element_size() or offset < 0 or data_start + offset + nbytes > size:
            raise TensorFileError("tensor table does not match the file (truncated or corrupted)")
        buffer = bytearray(nbytes)
        f.seek(data_start + offset)
        if f.readinto(buffer) != nbytes:
            raise TensorFileError("file ends inside a tensor (truncated)")
        tensor = torch.frombuffer(buffer, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        tensors.append(tensor.reshape(shape))
    return _join(header["object"], tensors)


def describe(obj: Any, indent: str = "") -> Iterator[str]:
    """Lines showing the structure of a loaded object, tensors as dtype and shape."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, dict | list | tuple) and value:
                yield f"{indent}{key}:"
                yield from describe(value, indent + "  ")
            else:
                yield f"{indent}{key}: {_summary(value)}"
    elif isinstance(obj, list | tuple):
        yield from describe(dict(enumerate(obj)), indent)
    else:
        yield f"{indent}{_summary(obj)}"


def _summary(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def main(argv: list[str]) -> int:
    """`python -m trainers.checkpoint.tensorfile FILE`: what a checkpoint file holds, one line per entry."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m trainers.checkpoint.tensorfile", description=main.__doc__)
    parser.add_argument(
        "path",
        type=Path,
        metavar="CHECKPOINT_FILE",
        help="a file the checkpointer wrote in a checkpoint dir step-N: shared.ckpt (the model, optimizer, schedule and progress) "
        "or rank-0000R.ckpt (rank R's random streams)",
    )
    path: Path = parser.parse_args(argv).path
    try:
        for line in describe(read_tensor_file(path)):
            print(line)
    except Exception as err:  # one line, whatever is wrong with the file
        print(f"{path}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
