import h5py
import numpy as np
import pytest

from trainers.config import DataConfig
from trainers.data import H5Split
from trainers.datasets import DataError, build_digits_hdf5, inspect_hdf5


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return build_digits_hdf5(tmp_path_factory.mktemp("data") / "digits.h5")


def test_built_in_digits_are_real_and_split(digits):
    info = inspect_hdf5(digits, DataConfig())
    assert (info.num_train + info.num_test, info.input_shape, info.num_classes) == (1797, (1, 8, 8), 10)
    with h5py.File(digits) as f:
        train, test = set(map(bytes, f["train/x"][:].reshape(info.num_train, -1))), f["test/x"][:]
        assert f["train/x"].dtype == np.uint8 and f["train/x"][:].max() == 16
        # Different images may coincide, but the split must not be a copy of the train set.
        assert sum(bytes(x.reshape(-1)) in train for x in test) < len(test) // 10


def test_reading_scales_uint8_and_keeps_index_order(digits):
    split = H5Split(digits, "train/x", "train/y")
    x, y = split.read(np.array([5, 2, 9]))
    with h5py.File(digits) as f:
        assert np.allclose(x.numpy(), f["train/x"][:][[5, 2, 9]] / 16.0)
        assert y.tolist() == f["train/y"][:][[5, 2, 9]].tolist()
    split.close()


def write(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f.create_dataset(name.replace("__", "/"), data=data)
    return path


def test_missing_file_and_non_hdf5_are_refused(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        inspect_hdf5(tmp_path / "nope.h5", DataConfig())
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="is not an HDF5 file"):
        inspect_hdf5(tmp_path / "text.h5", DataConfig())


def test_missing_datasets_are_named(tmp_path):
    path = write(tmp_path / "a.h5", train__x=np.zeros((4, 3)), train__y=np.zeros(4, int))
    with pytest.raises(DataError, match="test/x, test/y"):
        inspect_hdf5(path, DataConfig())


@pytest.mark.parametrize(
    "datasets, message",
    [
        (dict(train__x=np.zeros((4, 3)), train__y=np.zeros(3, int), test__x=np.zeros((2, 3)), test__y=np.zeros(2, int)), "rows"),
        (dict(train__x=np.zeros((4, 3)), train__y=np.zeros(4), test__x=np.zeros((2, 3)), test__y=np.zeros(2, int)), "integers"),
        (dict(train__x=np.zeros((4, 3)), train__y=np.zeros(4, int), test__x=np.zeros((2, 5)), test__y=np.zeros(2, int)), "differ in shape"),
        (dict(train__x=np.zeros(4), train__y=np.zeros(4, int), test__x=np.zeros(2), test__y=np.zeros(2, int)), "numeric N x"),
    ],
)
def test_wrong_shapes_or_dtypes_are_refused(tmp_path, datasets, message):
    with pytest.raises(DataError, match=message):
        inspect_hdf5(write(tmp_path / "bad.h5", **datasets), DataConfig())
