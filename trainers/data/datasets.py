"""HDF5 data sets on disk: building the built-in one, finding the shards data.path names, and
checking them. No torch here, so the login node can check a data set before it submits anything.

Layout: `train/x`, `train/y`, `val/x`, `val/y` and optionally a held-out `test/x`, `test/y` (names
configurable), in one file or spread over shards (a directory, a glob or a list; a split is the
rows of every shard holding it, in order). Files without a validation split (the layout before it
was named) validate on their test split, and then have no held-out one.
x is N x C x H x W (or N x D); uint8 inputs are scaled by the dataset's `scale` attribute
(default 1/255); y holds integer class labels 0..num_classes-1. `num_classes` is a file
attribute, or max(y)+1. Image models (cnn, resnet50) need N x C x H x W (check_model_input).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainers.config import DataConfig

if TYPE_CHECKING:  # h5py and numpy cost about 90 ms to import: launch.py avoids them (inspect_known)
    import h5py

DIGITS_FILE = "digits.h5"


class DataError(ValueError):
    """A data set that cannot be trained on; the message names the file and the fix."""


@dataclass(frozen=True)
class DatasetInfo:
    path: str
    num_train: int
    num_val: int
    input_shape: tuple[int, ...]
    num_classes: int
    files: tuple[str, ...] = ()  # every shard, in row order (one file: that file)
    val_split: tuple[str, str] = ("val/x", "val/y")  # the (inputs, labels) evaluated every epoch
    test_split: tuple[str, str] | None = None  # the held-out split, evaluated once at the end
    num_test: int = 0


def cache_dir() -> Path:
    return Path(os.environ.get("HPCTK_CACHE") or Path.home() / ".cache" / "hpc-toolkit")


def default_dataset_path() -> Path:
    return cache_dir() / DIGITS_FILE


def build_digits_hdf5(path: Path, val_fraction: float = 0.2, seed: int = 0) -> Path:
    """scikit-learn's bundled digits (no network) -> HDF5, written atomically."""
    import h5py
    import numpy as np

    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DataError("the built-in digits data set needs scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    images = digits.images.astype(np.uint8)[:, None, :, :]  # values 0..16, 8x8
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    num_val = int(round(len(labels) * val_fraction))
    val, train = order[:num_val], order[num_val:]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["num_classes"] = 10
        f.attrs["source"] = "sklearn.datasets.load_digits"
        for split, idx in (("train", np.sort(train)), ("val", np.sort(val))):
            x = f.create_dataset(f"{split}/x", data=images[idx])
            x.attrs["scale"] = 1.0 / 16.0
            f.create_dataset(f"{split}/y", data=labels[idx])
    os.replace(tmp, path)
    return path


GLOB_CHARACTERS = "*?["
SHARD_SUFFIXES = (".h5", ".hdf5")


def resolve_data_path(cfg: DataConfig) -> Path:
    """The one file ranks read (the built-in set, built when missing); see resolve_data_files."""
    return resolve_data_files(cfg)[0]


def resolve_data_files(cfg: DataConfig) -> list[Path]:
    """data.path as the absolute HDF5 files ranks read, in order: one file, a directory (its .h5
    and .hdf5 files), a glob, or a list of these. A directory's or glob's files are sorted by
    name, so every rank and every restart sees the same row order."""
    if cfg.path is None:
        path = default_dataset_path()
        if not path.exists():
            build_digits_hdf5(path)
        return [path]
    entries = [cfg.path] if isinstance(cfg.path, str | os.PathLike) else cfg.path
    if not isinstance(entries, list | tuple) or not entries or not all(isinstance(e, str | os.PathLike) for e in entries):
        raise DataError(f"data.path must be a file, a directory, a glob or a list of these, not {cfg.path!r}")
    files: list[Path] = []
    for entry in entries:
        files += _expand(str(entry))
    seen: set[Path] = set()
    for file in files:
        if file in seen:
            raise DataError(f"data.path names {file} more than once; list each shard once")
        seen.add(file)
    return files


def _expand(entry: str) -> list[Path]:
    """One entry's files, absolute, in name order (symlinks kept: a shard's name, not its
    target, sets the row order)."""
    path = Path(entry).expanduser()
    if any(c in entry for c in GLOB_CHARACTERS) and not path.exists():  # a name may hold [ ] * ? too
        anchor = Path(path.anchor) if path.is_absolute() else Path.cwd()
        pattern = str(path.relative_to(path.anchor)) if path.is_absolute() else str(path)
        matched = sorted(_absolute(p) for p in anchor.glob(pattern) if p.is_file())
        if not matched:
            raise DataError(f"data.path {entry!r} matches no file (a name holding [ ] * or ? is matched literally only if it exists)")
        return matched
    if path.is_dir():
        shards = sorted(_absolute(p) for p in path.iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
        if not shards:
            raise DataError(f"data.path {entry!r} is a directory with no .h5 or .hdf5 file in it")
        return shards
    return [_absolute(path)]


def _absolute(path: Path) -> Path:
    return Path(os.path.abspath(path))  # '..' removed, symlinks kept


def inspect_known(path: Path | Sequence[Path], cfg: DataConfig) -> DatasetInfo:
    """inspect_hdf5, remembered across processes in the cache dir for this version of the files
    (path, inode, size, mtime) and these names: launch.py then neither imports h5py nor reads
    every label again for a data set it checked before. The ranks inspect the files themselves."""
    files = [path] if isinstance(path, Path) else list(path)
    try:
        stats = [(str(f), f.stat()) for f in files]
    except OSError:
        return inspect_hdf5(files, cfg)  # names the missing file
    version = [[name, st.st_ino, st.st_size, st.st_mtime_ns] for name, st in stats] + [cfg.train_x, cfg.train_y, cfg.val_x, cfg.val_y, cfg.test_x, cfg.test_y]
    record = cache_dir() / "checked" / (hashlib.sha256(json.dumps(version).encode()).hexdigest()[:24] + ".json")
    try:
        known = json.loads(record.read_text())
        if known["version"] == version:
            info = known["info"]
            test_split = tuple(info["test_split"]) if info["test_split"] else None
            return DatasetInfo(
                **{
                    **info,
                    "input_shape": tuple(info["input_shape"]),
                    "files": tuple(info["files"]),
                    "val_split": tuple(info["val_split"]),
                    "test_split": test_split,
                }
            )
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: inspect the files
    info = inspect_hdf5(files, cfg)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=record.parent, suffix=".tmp", delete=False) as tmp:
            json.dump({"version": version, "info": dataclasses.asdict(info)}, tmp)
        os.replace(tmp.name, record)
    except OSError:
        pass  # a read-only cache only costs the next launch the inspection
    return info


def inspect_hdf5(path: Path | Sequence[Path], cfg: DataConfig) -> DatasetInfo:
    """Checks one HDF5 file, or shards whose splits are read as one: a split's rows are its
    dataset's rows in every shard that holds it, in the shards' order (a shard may hold only
    some of the splits)."""

    files = [path] if isinstance(path, Path) else list(path)
    parents = {f.parent for f in files}
    shown = str(files[0]) if len(files) == 1 else f"{parents.pop() if len(parents) == 1 else files[0].parent} ({len(files)} shards)"
    pairs = ((cfg.train_x, cfg.train_y), (cfg.val_x, cfg.val_y), (cfg.test_x, cfg.test_y))
    handles: list[h5py.File] = []
    try:
        splits = read_splits(files, pairs, handles)
        lacks = "the file has no" if len(files) == 1 else f"none of the {len(files)} files of data.path has a"
        if not splits[cfg.train_x]:
            raise DataError(f"{shown}: {lacks} training split {cfg.train_x} (set data.train_x/... to the names it has)")
        if splits[cfg.val_x]:
            val_split, test_split = (cfg.val_x, cfg.val_y), ((cfg.test_x, cfg.test_y) if splits[cfg.test_x] else None)
        elif splits[cfg.test_x]:  # the layout before the validation split was named: its test split validates
            val_split, test_split = (cfg.test_x, cfg.test_y), None
        else:
            raise DataError(f"{shown}: {lacks} validation split {cfg.val_x} (or {cfg.test_x}); set data.val_x/data.val_y to the names it has")
        kinds = {cfg.train_x: "train", val_split[0]: "validation", **({test_split[0]: "test"} if test_split else {})}
        used = {name: splits[name] for name in kinds}
        check_split_arrays(used, shown, sharded=len(files) > 1)
        first = check_shards_alike(used, kinds, shown, sharded=len(files) > 1)
        num_train, num_val, num_test = (
            sum(x.shape[0] for x, _ in splits[name]) if name else 0 for name in (cfg.train_x, val_split[0], test_split and test_split[0])
        )
        if num_train == 0:
            raise DataError(f"{shown}: {cfg.train_x} is empty")
        num_classes = checked_class_count(used, handles, shown, sharded=len(files) > 1)
        return DatasetInfo(shown, num_train, num_val, tuple(first.shape[1:]), num_classes, tuple(str(f) for f in files), val_split, test_split, num_test)
    finally:
        for f in handles:
            f.close()


Split = list[tuple["h5py.Dataset", "h5py.Dataset"]]  # a split's (inputs, labels) in each shard that holds it


def read_splits(files: list[Path], pairs: tuple[tuple[str, str], ...], handles: list[h5py.File]) -> dict[str, Split]:
    """Each split's (inputs, labels) datasets, by its inputs' name, from every file that holds
    it; each file opened is appended to `handles` (the caller closes them)."""
    import h5py

    names = [name for pair in pairs for name in pair]
    splits: dict[str, Split] = {x_name: [] for x_name, _ in pairs}
    for file in files:
        if not file.exists():
            raise DataError(f"data.path {str(file)!r} does not exist")
        if not file.is_file() or not h5py.is_hdf5(file):
            raise DataError(f"data.path {str(file)!r} is not an HDF5 file")
        f = h5py.File(file, "r")
        handles.append(f)
        held = [name for name in names if isinstance(f.get(name), h5py.Dataset)]
        if not held:
            raise DataError(f"{file} holds none of {', '.join(names)} (set data.train_x/... to the names it has)")
        for x_name, y_name in pairs:
            if (x_name in held) != (y_name in held):
                has, lacks = (x_name, y_name) if x_name in held else (y_name, x_name)
                raise DataError(f"{file} holds {has} without {lacks}; a shard holds a split's inputs and labels together")
            if x_name in held:
                splits[x_name].append((f[x_name], f[y_name]))
    return splits


def check_split_arrays(used: dict[str, Split], shown: str, sharded: bool) -> None:
    """Inputs numeric N x ..., labels integer N, in every shard of every split used."""
    import numpy as np

    for x, y in (pair for split in used.values() for pair in split):
        at = f"{x.file.filename}: " if sharded else f"{shown}: "
        if x.shape[0] != y.shape[0] or y.ndim != 1:
            raise DataError(f"{at}{x.name} has {x.shape[0]} rows but {y.name} has shape {y.shape}")
        if not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{at}labels {y.name} must be integers, not {y.dtype}")
        if not (np.issubdtype(x.dtype, np.number) and x.ndim >= 2):
            raise DataError(f"{at}inputs {x.name} must be numeric N x ..., not {x.dtype} {x.shape}")


def check_shards_alike(used: dict[str, Split], kinds: dict[str, str], shown: str, sharded: bool) -> h5py.Dataset:
    """Every split's inputs shaped, typed and scaled as the first training shard's; returns that shard's inputs."""
    first = next(iter(used.values()))[0][0]
    for name, split in used.items():
        for x, _ in split:
            if x.shape[1:] != first.shape[1:]:
                in_file = f" in {x.file.filename}" if sharded else ""
                raise DataError(f"{shown}: train inputs {first.shape[1:]} and {kinds[name]} inputs {x.shape[1:]}{in_file} differ in shape")
            if x.dtype != first.dtype:
                raise DataError(f"{shown}: inputs are {first.dtype} in {first.file.filename} but {x.dtype} in {x.file.filename}; store every shard alike")
            if x.attrs.get("scale") != first.attrs.get("scale"):
                scales = f"{first.attrs.get('scale')} in {first.file.filename} but {x.attrs.get('scale')} in {x.file.filename}"
                raise DataError(f"{shown}: the inputs' scale attribute is {scales}; store every shard alike")
    return first


def checked_class_count(used: dict[str, Split], handles: list[h5py.File], shown: str, sharded: bool) -> int:
    """The files' num_classes attribute, else the largest label + 1; every label of the splits used within it."""
    labels = [y for split in used.values() for _, y in split if y.shape[0]]
    ranges = [(f"{y.file.filename}:{y.name.lstrip('/')}" if sharded else y.name.lstrip("/"), label_range(y)) for y in labels]
    declared = max(int(f.attrs.get("num_classes", 0)) for f in handles)
    num_classes = declared or max(high for _, (_, high) in ranges) + 1
    for name, (low, high) in ranges:
        if low < 0 or high >= num_classes:
            source = "the file's num_classes attribute" if declared else "max label + 1"
            raise DataError(
                f"{shown}: labels in {name} run {low}..{high}, outside 0..{num_classes - 1} for num_classes={num_classes} "
                f"({source}); store labels 0..num_classes-1"
            )
    return num_classes


def label_range(labels: h5py.Dataset, chunk: int = 1 << 22) -> tuple[int, int]:
    """(min, max) of a non-empty label array, read a slice at a time: labels may be large."""
    low, high = None, None
    for start in range(0, labels.shape[0], chunk):
        part = labels[start : start + chunk]
        low = int(part.min()) if low is None else min(low, int(part.min()))
        high = int(part.max()) if high is None else max(high, int(part.max()))
    assert low is not None and high is not None
    return low, high


# Models that read images N x C x H x W (trainers.models); mlp flattens any N x ... input.
IMAGE_MODELS = ("cnn", "resnet50")
CHANNEL_COUNTS = (1, 3, 4)  # grey, RGB, RGBA: a small last axis after a larger one is channels-last


def augmented_shape(cfg: DataConfig, info: DatasetInfo) -> tuple[int, ...]:
    """The model's input shape once data.crop has cut the images; a crop or flip the inputs
    cannot take is refused (torch-free, from shapes)."""
    if cfg.crop is None and not cfg.flip:
        return info.input_shape
    shape = " x ".join(["N", *map(str, info.input_shape)])
    if len(info.input_shape) != 3:
        raise DataError(f"{info.path}: data.crop and data.flip take images N x C x H x W, but the inputs are {shape}")
    if cfg.crop is None:
        return info.input_shape
    channels, height, width = info.input_shape
    largest = min(height, width) + 2 * cfg.crop_padding
    if cfg.crop > largest:
        raise DataError(f"{info.path}: data.crop={cfg.crop} is larger than the {height} x {width} images padded by {cfg.crop_padding}; crop at most {largest}")
    return (channels, cfg.crop, cfg.crop)


def check_model_input(model: str, info: DatasetInfo, x_name: str = "train/x") -> None:
    """Inputs a model cannot read, refused before any rank starts (torch-free, from shapes)."""
    if model not in IMAGE_MODELS:
        return
    shape = " x ".join(["N", *map(str, info.input_shape)])
    if len(info.input_shape) != 3:
        fix = "add a channel axis (x[:, None]) for one-channel images" if len(info.input_shape) == 2 else "use model=mlp for flat inputs"
        raise DataError(f"{info.path}: model={model} needs images N x C x H x W, but {x_name} is {shape}; {fix}")
    channels, height, width = info.input_shape
    if width in CHANNEL_COUNTS and channels not in CHANNEL_COUNTS and channels > width:
        raise DataError(
            f"{info.path}: {x_name} is {shape}, which looks channels-last (N x H x W x C); model={model} expects N x C x H x W: store x.transpose(0, 3, 1, 2)"
        )
    if model == "cnn" and min(height, width) < 2:
        raise DataError(f"{info.path}: model=cnn pools 2 x 2, but {x_name} images are {height} x {width}; use model=mlp")
