"""HDF5 data sets on disk: building the built-in one and checking any one. No torch here, so
the login node can check a data set before it submits anything.

Layout of a data set file: `train/x`, `train/y`, `test/x`, `test/y` (names configurable).
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
    num_test: int
    input_shape: tuple[int, ...]
    num_classes: int


def cache_dir() -> Path:
    return Path(os.environ.get("HPCTK_CACHE") or Path.home() / ".cache" / "hpc-toolkit")


def default_dataset_path() -> Path:
    return cache_dir() / DIGITS_FILE


def build_digits_hdf5(path: Path, test_fraction: float = 0.2, seed: int = 0) -> Path:
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
    num_test = int(round(len(labels) * test_fraction))
    test, train = order[:num_test], order[num_test:]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["num_classes"] = 10
        f.attrs["source"] = "sklearn.datasets.load_digits"
        for split, idx in (("train", np.sort(train)), ("test", np.sort(test))):
            x = f.create_dataset(f"{split}/x", data=images[idx])
            x.attrs["scale"] = 1.0 / 16.0
            f.create_dataset(f"{split}/y", data=labels[idx])
    os.replace(tmp, path)
    return path


def resolve_data_path(cfg: DataConfig) -> Path:
    """The absolute path ranks will read; builds the built-in set when no path is given."""
    if cfg.path is None:
        path = default_dataset_path()
        if not path.exists():
            build_digits_hdf5(path)
        return path
    return Path(cfg.path).expanduser().resolve()


def inspect_known(path: Path, cfg: DataConfig) -> DatasetInfo:
    """inspect_hdf5, remembered across processes in the cache dir for this version of the file
    (path, inode, size, mtime) and these names: launch.py then neither imports h5py nor reads
    every label again for a data set it checked before. The ranks inspect the file themselves."""
    try:
        stat = path.stat()
    except OSError:
        return inspect_hdf5(path, cfg)  # names the missing file
    version = [str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, cfg.train_x, cfg.train_y, cfg.test_x, cfg.test_y]
    record = cache_dir() / "checked" / (hashlib.sha256(json.dumps(version).encode()).hexdigest()[:24] + ".json")
    try:
        known = json.loads(record.read_text())
        if known["version"] == version:
            return DatasetInfo(**{**known["info"], "input_shape": tuple(known["info"]["input_shape"])})
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none yet, or unreadable: inspect the file
    info = inspect_hdf5(path, cfg)
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=record.parent, suffix=".tmp", delete=False) as tmp:
            json.dump({"version": version, "info": dataclasses.asdict(info)}, tmp)
        os.replace(tmp.name, record)
    except OSError:
        pass  # a read-only cache only costs the next launch the inspection
    return info


def inspect_hdf5(path: Path, cfg: DataConfig) -> DatasetInfo:
    import h5py
    import numpy as np

    if not path.exists():
        raise DataError(f"data.path {str(path)!r} does not exist")
    if not path.is_file() or not h5py.is_hdf5(path):
        raise DataError(f"data.path {str(path)!r} is not an HDF5 file")
    with h5py.File(path, "r") as f:
        missing = [name for name in (cfg.train_x, cfg.train_y, cfg.test_x, cfg.test_y) if not isinstance(f.get(name), h5py.Dataset)]
        if missing:
            raise DataError(f"{path} lacks the dataset(s) {', '.join(missing)} (set data.train_x/... to the names it has)")
        train_x, train_y, test_x, test_y = (f[name] for name in (cfg.train_x, cfg.train_y, cfg.test_x, cfg.test_y))
        for x, y in ((train_x, train_y), (test_x, test_y)):
            if x.shape[0] != y.shape[0] or y.ndim != 1:
                raise DataError(f"{path}: {x.name} has {x.shape[0]} rows but {y.name} has shape {y.shape}")
            if not np.issubdtype(y.dtype, np.integer):
                raise DataError(f"{path}: labels {y.name} must be integers, not {y.dtype}")
            if not (np.issubdtype(x.dtype, np.number) and x.ndim >= 2):
                raise DataError(f"{path}: inputs {x.name} must be numeric N x ..., not {x.dtype} {x.shape}")
        if train_x.shape[1:] != test_x.shape[1:]:
            raise DataError(f"{path}: train inputs {train_x.shape[1:]} and test inputs {test_x.shape[1:]} differ in shape")
        if train_x.shape[0] == 0:
            raise DataError(f"{path}: {cfg.train_x} is empty")
        ranges = {y.name.lstrip("/"): label_range(y) for y in (train_y, test_y) if y.shape[0]}
        declared = int(f.attrs.get("num_classes", 0))
        num_classes = declared or max(high for _, high in ranges.values()) + 1
        for name, (low, high) in ranges.items():
            if low < 0 or high >= num_classes:
                where = "the file's num_classes attribute" if declared else "max label + 1"
                raise DataError(
                    f"{path}: labels in {name} run {low}..{high}, outside 0..{num_classes - 1} for num_classes={num_classes} "
                    f"({where}); store labels 0..num_classes-1"
                )
        return DatasetInfo(str(path), train_x.shape[0], test_x.shape[0], tuple(train_x.shape[1:]), num_classes)


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
