"""Reading batches from an HDF5 data set into CPU tensors."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import torch

IN_MEMORY_LIMIT_BYTES = 1 << 30  # smaller splits are read once and kept in memory


class H5Split:
    """One split (inputs x, labels y) of an HDF5 file; `read(indices)` returns a batch."""

    def __init__(self, path: Path, x_name: str, y_name: str) -> None:
        self._file = h5py.File(path, "r")
        self._x = self._file[x_name]
        self._y = self._file[y_name]
        self.scale = float(self._x.attrs.get("scale", 1.0 / 255.0 if self._x.dtype == np.uint8 else 1.0))
        self._cached_x = self._x[:] if self._x.nbytes <= IN_MEMORY_LIMIT_BYTES else None
        self._cached_y = self._y[:]

    def __len__(self) -> int:
        return int(self._y.shape[0])

    def read(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cached_x is not None:
            x = self._cached_x[indices]
        else:
            # h5py reads fancy indices only in increasing order: sort, read, restore the order.
            order = np.argsort(indices)
            x = np.empty((len(indices), *self._x.shape[1:]), dtype=self._x.dtype)
            x[order] = self._x[indices[order]]
        inputs = torch.from_numpy(np.ascontiguousarray(x)).to(torch.float32).mul_(self.scale)
        return inputs, torch.from_numpy(self._cached_y[indices].astype(np.int64))

    def close(self) -> None:
        self._file.close()
