"""Write the sharded HDF5 layout the loader reads fastest, from numpy arrays or a folder of images.

    python -m trainers.convert numpy --x train_x.npy --y train_y.npy --val-x .. --val-y .. [--test-x .. --test-y ..] --out DIR
    python -m trainers.convert images TRAIN_FOLDER (--val VAL_FOLDER | --val-fraction 0.02) [--test TEST_FOLDER] --size 256 --out DIR

DIR receives train-00000.h5, ... (train/x, train/y), val-00000.h5, ... (val/x, val/y: the
validation split, evaluated every epoch) and, when given, test-00000.h5, ... (test/x, test/y: a
held-out test split, evaluated once at the end of a completed run), each about --shard-mb; point data.path at DIR. Inputs are stored contiguous and uncompressed
(the loader reads their rows with one pread each). Images are decoded once, resized so the
shorter side is --size, centre-cropped to --size x --size and stored as uint8 N x 3 x S x S;
an image folder holds one sub-folder per class (ImageFolder's layout), classes in name order.

The shards are written into a temporary directory, fsynced, and renamed to DIR at the end: an
interrupted conversion (Ctrl-C, SIGTERM) leaves nothing behind, and nothing that looks finished.
numpy files are loaded memory-mapped, never unpickled. No torch here: it runs on a login node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from trainers.checkpoint.storage import fsync_path

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm")


class ConvertError(ValueError):
    """Input the converter cannot use; the message names it and the fix."""


@dataclass(frozen=True)
class Split:
    """Rows to write for one split: `count` samples of `shape`/`dtype`, produced in blocks."""

    name: str  # "train", "val" or "test"
    count: int
    shape: tuple[int, ...]
    dtype: np.dtype
    blocks: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]  # (x rows, labels), in order
    scale: float | None = None


def write_shards(out: Path, splits: Sequence[Split], shard_mb: float, attrs: dict[str, object]) -> list[Path]:
    """Every split's rows into shards of about `shard_mb`, atomically as a directory."""
    if out.exists():
        raise ConvertError(f"{out} exists; remove it or choose another --out (shards are never overwritten)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as err:
        raise ConvertError(f"cannot create {out}: {err.strerror}") from None
    written: list[Path] = []
    try:
        for split in splits:
            row_bytes = int(np.prod(split.shape, dtype=np.int64)) * split.dtype.itemsize
            per_shard = max(1, int(shard_mb * (1 << 20)) // max(1, row_bytes))
            written += _write_split(tmp, split, per_shard, attrs)
        for path in [*written, tmp]:  # on disk before the name says the shards are complete
            fsync_path(path)
        try:
            os.rename(tmp, out)
        except OSError:
            raise ConvertError(f"{out} appeared while converting; remove it or choose another --out") from None
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / path.name for path in written]


def _write_split(tmp: Path, split: Split, per_shard: int, attrs: dict[str, object]) -> list[Path]:
    paths: list[Path] = []
    file: h5py.File | None = None
    at = filled = 0
    for x, y in split.blocks():
        while len(x):
            if file is None or filled == file[f"{split.name}/x"].shape[0]:
                if file is not None:
                    file.close()
                rows = min(per_shard, split.count - at)
                path = tmp / f"{split.name}-{len(paths):05d}.h5"
                file = h5py.File(path, "w")
                for key, value in attrs.items():
                    file.attrs[key] = value
                dataset = file.create_dataset(f"{split.name}/x", shape=(rows, *split.shape), dtype=split.dtype)  # contiguous
                if split.scale is not None:
                    dataset.attrs["scale"] = split.scale
                file.create_dataset(f"{split.name}/y", shape=(rows,), dtype=np.int64)
                paths.append(path)
                filled = 0
            take = min(len(x), file[f"{split.name}/x"].shape[0] - filled)
            file[f"{split.name}/x"][filled : filled + take] = x[:take]
            file[f"{split.name}/y"][filled : filled + take] = y[:take]
            filled, at, x, y = filled + take, at + take, x[take:], y[take:]
    if file is not None:
        file.close()
    if at != split.count:
        raise ConvertError(f"{split.name}: {at} rows written, {split.count} expected")
    return paths


# numpy arrays


def numpy_split(name: str, x_path: Path, y_path: Path, block_rows: int = 4096) -> Split:
    x, y = _load(x_path), _load(y_path)
    if x.ndim < 2 or not np.issubdtype(x.dtype, np.number):
        raise ConvertError(f"{x_path}: inputs must be numeric N x ..., not {x.dtype} {x.shape}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ConvertError(f"{y_path}: labels must be a 1-D integer array, not {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise ConvertError(f"{x_path} has {len(x)} rows but {y_path} has {len(y)}")
    if len(y) and y.min() < 0:
        raise ConvertError(f"{y_path}: labels must be 0..num_classes-1, found {y.min()}")

    native = np.dtype(x.dtype).newbyteorder("=")  # stored in this machine's byte order: rows are read raw

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, len(x), block_rows):
            yield np.ascontiguousarray(x[start : start + block_rows], dtype=native), np.asarray(y[start : start + block_rows], dtype=np.int64)

    return Split(name, len(x), tuple(x.shape[1:]), native, blocks)


def _load(path: Path) -> np.ndarray:
    try:
        loaded = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ConvertError(f"{path} does not exist") from None
    except OSError as err:
        raise ConvertError(f"{path} cannot be read ({err.strerror or err})") from None
    except ValueError as err:
        raise ConvertError(f"{path} is not a plain .npy array ({' '.join(str(err).split())})") from None
    if not isinstance(loaded, np.ndarray):
        raise ConvertError(f"{path} is not a .npy array (an .npz archive? save each array with numpy.save)")
    return loaded


# a folder of images


def list_images(folder: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """(class names, (file, label) pairs): one sub-folder per class, both in name order."""
    if not folder.is_dir():
        raise ConvertError(f"{folder} is not a directory of class folders")
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise ConvertError(f"{folder} holds no class folders (expected {folder}/<class>/<image>)")
    files = [(p, label) for label, name in enumerate(classes) for p in sorted((folder / name).rglob("*")) if p.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise ConvertError(f"{folder} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    return classes, files


def decode_image(path: Path, size: int) -> np.ndarray:
    """One image as uint8 3 x size x size: RGB, shorter side resized to size, centre crop."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image.draft("RGB", (size, size))  # JPEG: decode at a reduced scale when it is larger
            rgb = image.convert("RGB")
    except (OSError, ValueError) as err:
        raise ConvertError(f"{path} cannot be decoded as an image ({err}); remove or replace it") from None
    width, height = rgb.size
    factor = size / min(width, height)
    resized = rgb.resize((max(size, round(width * factor)), max(size, round(height * factor))), Image.Resampling.BILINEAR)
    left, top = (resized.width - size) // 2, (resized.height - size) // 2
    return np.asarray(resized.crop((left, top, left + size, top + size)), dtype=np.uint8).transpose(2, 0, 1)


def image_split(name: str, files: list[tuple[Path, int]], size: int, workers: int, block_rows: int = 256) -> Split:
    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for start in range(0, len(files), block_rows):
                block = files[start : start + block_rows]
                images = list(pool.map(decode_image, [p for p, _ in block], [size] * len(block), chunksize=16))
                yield np.stack(images), np.array([label for _, label in block], dtype=np.int64)

    return Split(name, len(files), (3, size, size), np.dtype(np.uint8), blocks, scale=1.0 / 255.0)


def held_out(files: list[tuple[Path, int]], fraction: float, seed: int) -> tuple[list[tuple[Path, int]], list[tuple[Path, int]]]:
    """(train, validation): a seeded `fraction` of the images held out for validation."""
    order = np.random.default_rng(seed).permutation(len(files))
    count = int(round(len(files) * fraction))
    chosen = set(order[:count].tolist())
    return [f for i, f in enumerate(files) if i not in chosen], [f for i, f in enumerate(files) if i in chosen]


def class_count(label_files: list[tuple[Path, str]], declared: int | None) -> int:
    """num_classes: `declared` (every label below it), else the largest label + 1. Labels that
    leave a class without a training sample are said (labels 1..10 for ten classes make 11,
    class 0 empty), not found later in the model's output size."""
    if declared is not None and declared < 1:
        raise ConvertError(f"--num-classes={declared} must be >= 1")
    tops = {split: (path, int(_load(path).max())) for path, split in label_files if len(_load(path))}
    count = declared if declared is not None else max(top for _, top in tops.values()) + 1
    for split, (path, top) in tops.items():
        if top >= count:
            raise ConvertError(f"{path}: {split} label {top} is outside 0..{count - 1} (--num-classes={count})")
    train = np.unique(np.asarray(_load(label_files[0][0])))
    missing = sorted(set(range(count)) - set(train.tolist()))
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        print(
            f"note: {count} classes (labels 0..{count - 1}), but no training sample has label {shown}; "
            f"if there are {count - len(missing)} classes, relabel them 0..{count - len(missing) - 1}",
            file=sys.stderr,
        )
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.convert", description=__doc__.split("\n\n")[0])
    sources = parser.add_subparsers(dest="source", required=True)
    arrays = sources.add_parser("numpy", help="train, validation (and held-out test) arrays in .npy files")
    arrays.add_argument("--x", type=Path, required=True, help="train inputs, N x ... (.npy)")
    arrays.add_argument("--y", type=Path, required=True, help="train labels, N integers (.npy)")
    arrays.add_argument("--val-x", type=Path, help="validation inputs (evaluated every epoch)")
    arrays.add_argument("--val-y", type=Path, help="validation labels")
    arrays.add_argument("--test-x", type=Path, help="optional held-out test inputs (evaluated once, at the end)")
    arrays.add_argument("--test-y", type=Path, help="optional held-out test labels")
    arrays.add_argument("--scale", type=float, help="factor from stored values to inputs (uint8 default: 1/255)")
    arrays.add_argument("--num-classes", type=int, help="the class count (default: the largest label + 1); every label must be below it")
    images = sources.add_parser("images", help="a folder with one sub-folder of images per class")
    images.add_argument("folder", type=Path)
    images.add_argument("--val", type=Path, help="the validation images, in the same class folders")
    images.add_argument("--val-fraction", type=float, default=0.0, help="else hold out this fraction of the images for validation")
    images.add_argument("--test", type=Path, help="optional held-out test images, in the same class folders (evaluated once, at the end)")
    images.add_argument("--size", type=int, default=256, help="stored images are size x size (shorter side resized, centre crop)")
    images.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes")
    images.add_argument("--seed", type=int, default=0)
    for sub in (arrays, images):
        sub.add_argument("--out", type=Path, required=True, help="directory to create for the shards")
        sub.add_argument("--shard-mb", type=float, default=1024.0, help="about this many MiB per shard")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stopped)  # a batch job's time limit: clean up like Ctrl-C
    try:
        splits, attrs = _plan(args)
        paths = write_shards(args.out, splits, args.shard_mb, attrs)
    except ConvertError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    counts = ", ".join(f"{s.name} {s.count}" for s in splits)
    print(f"wrote {len(paths)} shards to {args.out} ({counts} samples, {attrs['num_classes']} classes); train with data.path={args.out}")
    return 0


def _plan(args: argparse.Namespace) -> tuple[list[Split], dict[str, object]]:
    if args.shard_mb <= 0:
        raise ConvertError(f"--shard-mb={args.shard_mb} must be > 0")
    if args.source == "numpy":
        if args.val_x is None or args.val_y is None:
            raise ConvertError(
                "give --val-x and --val-y: training evaluates on a validation split every epoch (--test-x/--test-y: an optional held-out test split)"
            )
        if (args.test_x is None) != (args.test_y is None):
            raise ConvertError("give both --test-x and --test-y, or neither (the held-out test split is optional)")
        splits = [numpy_split("train", args.x, args.y), numpy_split("val", args.val_x, args.val_y)]
        if args.test_x is not None:
            splits.append(numpy_split("test", args.test_x, args.test_y))
        if splits[0].count == 0:
            raise ConvertError(f"{args.x} holds no rows")
        if args.scale is not None:
            splits = [Split(s.name, s.count, s.shape, s.dtype, s.blocks, args.scale) for s in splits]
        labels = [(args.y, "train"), (args.val_y, "val"), *([(args.test_y, "test")] if args.test_y is not None else [])]
        return splits, {"num_classes": class_count(labels, args.num_classes)}
    if args.size < 1 or args.workers < 1:
        raise ConvertError(f"--size={args.size} and --workers={args.workers} must be >= 1")
    if not 0.0 <= args.val_fraction < 1.0:
        raise ConvertError(f"--val-fraction={args.val_fraction} must be in [0, 1)")
    if args.val is None and args.val_fraction == 0.0:
        raise ConvertError("give --val VAL_FOLDER or --val-fraction F: training evaluates on a validation split every epoch")
    classes, files = list_images(args.folder)
    if args.val is not None:
        val = same_classes(args.val, classes, args.folder)
        train = files
    else:
        train, val = held_out(files, args.val_fraction, args.seed)
    if not val or not train:
        raise ConvertError(f"--val-fraction={args.val_fraction} of {len(files)} images leaves an empty split; change the fraction")
    splits = [image_split("train", train, args.size, args.workers), image_split("val", val, args.size, args.workers)]
    if args.test is not None:
        splits.append(image_split("test", same_classes(args.test, classes, args.folder), args.size, args.workers))
    return splits, {"num_classes": len(classes), "classes": json.dumps(classes)}


def same_classes(folder: Path, classes: list[str], train_folder: Path) -> list[tuple[Path, int]]:
    """The images of another split's folder, which must hold the training folder's classes."""
    found, files = list_images(folder)
    if found != classes:
        raise ConvertError(f"{folder} has classes {found[:3]}... but {train_folder} has {classes[:3]}...; give both the same class folders")
    return files


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
