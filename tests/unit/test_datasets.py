import h5py
import numpy as np
import pytest

from trainers.config import DataConfig
from trainers.data.datasets import DataError, build_digits_hdf5, inspect_hdf5
from trainers.data.reading import H5Split


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return build_digits_hdf5(tmp_path_factory.mktemp("data") / "digits.h5")


def test_built_in_digits_are_real_and_split(digits):
    info = inspect_hdf5(digits, DataConfig())
    assert (info.num_train + info.num_val, info.input_shape, info.num_classes) == (1797, (1, 8, 8), 10)
    with h5py.File(digits) as f:
        train, test = set(map(bytes, f["train/x"][:].reshape(info.num_train, -1))), f[info.val_split[0]][:]
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
    with pytest.raises(DataError, match=r"the file has no validation split val/x \(or test/x\)"):
        inspect_hdf5(path, DataConfig())


def test_the_validation_split_is_val_a_test_split_beside_it_is_held_out_and_files_before_val_validate_on_test(tmp_path):
    pairs = {f"{split}__{axis}": np.zeros((n, 3)) if axis == "x" else np.arange(n) % 2 for split, n in (("train", 8), ("val", 4), ("test", 2)) for axis in "xy"}
    info = inspect_hdf5(write(tmp_path / "three.h5", **pairs), DataConfig())
    assert (info.val_split, info.num_val, info.test_split, info.num_test) == (("val/x", "val/y"), 4, ("test/x", "test/y"), 2)
    old = {key: value for key, value in pairs.items() if not key.startswith("val")}
    info = inspect_hdf5(write(tmp_path / "old.h5", **old), DataConfig())
    assert (info.val_split, info.num_val, info.test_split, info.num_test) == (("test/x", "test/y"), 2, None, 0)


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


def shard(path, **datasets):
    path.parent.mkdir(parents=True, exist_ok=True)
    return write(path, **datasets)


def test_shards_read_as_one_split_in_order_through_h5py_when_chunked(tmp_path, monkeypatch):
    from trainers.data import reading as data_module

    monkeypatch.setattr(data_module, "IN_MEMORY_LIMIT_BYTES", 0)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(50, 4)).astype(np.float32), np.arange(50) % 5
    a = tmp_path / "a.h5"
    with h5py.File(a, "w") as f:  # chunked and compressed: read by h5py
        f.create_dataset("train/x", data=x[:20], chunks=(4, 4), compression="gzip")
        f["train/y"] = y[:20]
    b = shard(tmp_path / "b.h5", train__x=x[20:], train__y=y[20:])  # contiguous: read by pread
    c = shard(tmp_path / "c.h5", test__x=x[:3], test__y=y[:3])
    info = inspect_hdf5([a, b, c], DataConfig())
    assert (info.num_train, info.num_val, info.num_classes, info.files) == (50, 3, 5, (str(a), str(b), str(c)))
    split = H5Split([a, b, c], "train/x", "train/y")
    picks = np.array([49, 0, 19, 20, 7, 33])
    batch = split.__getitems__(picks)
    assert np.array_equal(batch.x.numpy(), x[picks]) and batch.y.tolist() == y[picks].tolist()
    split.close()


@pytest.mark.parametrize(
    "second, message",
    [
        (dict(train__x=np.zeros((4, 3), np.float32), train__y=np.zeros(4, int)), "inputs are float64 in .* but float32"),
        (dict(train__x=np.zeros((4, 5)), train__y=np.zeros(4, int)), "differ in shape"),
        (dict(train__x=np.zeros((4, 3))), "holds train/x without train/y"),
        (dict(other=np.zeros(3)), "holds none of train/x"),
    ],
)
def test_shards_that_do_not_fit_together_are_refused(tmp_path, second, message):
    first = shard(tmp_path / "a.h5", train__x=np.zeros((4, 3)), train__y=np.zeros(4, int), test__x=np.zeros((2, 3)), test__y=np.zeros(2, int))
    with pytest.raises(DataError, match=message):
        inspect_hdf5([first, shard(tmp_path / "b.h5", **second)], DataConfig())


def test_a_split_no_shard_holds_is_named(tmp_path):
    a = shard(tmp_path / "a.h5", train__x=np.zeros((4, 3)), train__y=np.zeros(4, int))
    b = shard(tmp_path / "b.h5", train__x=np.zeros((4, 3)), train__y=np.zeros(4, int))
    with pytest.raises(DataError, match=r"none of the 2 files of data.path has a validation split val/x \(or test/x\)"):
        inspect_hdf5([a, b], DataConfig())


def test_data_path_takes_a_directory_a_glob_or_a_list(tmp_path, monkeypatch):
    from trainers.data.datasets import resolve_data_files

    for name in ("b-1.h5", "a-2.hdf5", "b-0.h5"):
        shard(tmp_path / "d" / name, train__x=np.zeros((2, 3)), train__y=np.zeros(2, int))
    (tmp_path / "d" / "notes.txt").write_text("x")
    d = tmp_path / "d"
    assert [p.name for p in resolve_data_files(DataConfig(path=str(d)))] == ["a-2.hdf5", "b-0.h5", "b-1.h5"]
    assert [p.name for p in resolve_data_files(DataConfig(path=str(d / "b-*.h5")))] == ["b-0.h5", "b-1.h5"]
    monkeypatch.chdir(tmp_path)
    listed = resolve_data_files(DataConfig(path=["d/b-1.h5", "d/a-*"]))
    assert listed == [d / "b-1.h5", d / "a-2.hdf5"] and all(p.is_absolute() for p in listed)
    for path, message in (
        ("d/z-*.h5", "matches no file"),
        (str(tmp_path), "no .h5 or .hdf5 file"),
        (["d/b-0.h5", "d/b-*"], "more than once"),
        (7, "must be a file"),
    ):
        with pytest.raises(DataError, match=message):
            resolve_data_files(DataConfig(path=path))


@pytest.mark.parametrize("limit", [0, 1 << 30], ids=["direct", "in-memory"])
def test_inputs_stored_big_endian_are_read_as_their_values(tmp_path, monkeypatch, limit):
    from trainers.data import reading as data_module

    monkeypatch.setattr(data_module, "IN_MEMORY_LIMIT_BYTES", limit)
    values = np.arange(24, dtype=">f4").reshape(6, 4)
    path = write(tmp_path / "be.h5", x=values, y=np.arange(6))
    split = H5Split(path, "x", "y")
    batch = split.__getitems__(np.array([4, 1]))
    assert batch.x.tolist() == values[[4, 1]].astype(np.float32).tolist()
    split.close()


def test_names_holding_glob_characters_and_symlinked_shards(tmp_path):
    from trainers.data.datasets import resolve_data_files

    literal = shard(tmp_path / "run[1]" / "data.h5", train__x=np.zeros((2, 3)), train__y=np.zeros(2, int))
    assert resolve_data_files(DataConfig(path=str(literal))) == [literal]
    assert resolve_data_files(DataConfig(path=str(literal.parent))) == [literal]
    store = tmp_path / "store"
    for name in ("zz.h5", "aa.h5"):
        shard(store / name, train__x=np.zeros((2, 3)), train__y=np.zeros(2, int))
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "train-0.h5").symlink_to(store / "zz.h5")
    (tmp_path / "links" / "train-1.h5").symlink_to(store / "aa.h5")
    # The shards' names set the row order, whatever they point to.
    assert [p.name for p in resolve_data_files(DataConfig(path=str(tmp_path / "links")))] == ["train-0.h5", "train-1.h5"]
