"""The converters write shards the data sets read back exactly, atomically, from numpy arrays
(never unpickled) and from folders of images (decoded once to uint8)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from PIL import Image

from trainers.config import DataConfig
from trainers.data import reading as data_module
from trainers.data.convert import main
from trainers.data.datasets import inspect_hdf5, resolve_data_files
from trainers.data.reading import H5Split


@pytest.fixture
def arrays(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (1000, 3, 6, 6), dtype=np.uint8), rng.integers(0, 7, 1000)
    tx, ty = rng.integers(0, 256, (90, 3, 6, 6), dtype=np.uint8), rng.integers(0, 7, 90)
    for name, value in (("x", x), ("y", y), ("tx", tx), ("ty", ty)):
        np.save(tmp_path / f"{name}.npy", value)
    return tmp_path, x, y, tx, ty


def test_numpy_arrays_become_shards_read_back_exactly(arrays, monkeypatch, capsys):
    monkeypatch.setattr(data_module, "IN_MEMORY_LIMIT_BYTES", 0)  # read each row from its shard
    d, x, y, tx, ty = arrays
    out = d / "shards"
    np.save(d / "hx.npy", tx[:30]), np.save(d / "hy.npy", ty[:30])  # a held-out test split beside the validation one
    val = ["--val-x", str(d / "tx.npy"), "--val-y", str(d / "ty.npy")]
    args = ["numpy", "--x", str(d / "x.npy"), "--y", str(d / "y.npy"), *val, "--test-x", str(d / "hx.npy"), "--test-y", str(d / "hy.npy")]
    assert main([*args, "--out", str(out), "--shard-mb", "0.03"]) == 0
    assert f"data.path={out}" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == ["test-00000.h5", *(f"train-0000{i}.h5" for i in range(4)), "val-00000.h5"]  # 108 B rows, ~291 per shard
    with h5py.File(out / "train-00000.h5") as f:
        assert f["train/x"].chunks is None and f["train/x"].compression is None  # rows can be read directly
    files = resolve_data_files(DataConfig(path=str(out)))
    info = inspect_hdf5(files, DataConfig())
    assert (info.num_train, info.num_val, info.input_shape, info.num_classes) == (1000, 90, (3, 6, 6), int(max(y.max(), ty.max())) + 1)
    assert (info.val_split, info.test_split, info.num_test) == (("val/x", "val/y"), ("test/x", "test/y"), 30)
    train = H5Split(files, "train/x", "train/y")
    picks = np.array([999, 0, 290, 291, 582, 5])
    batch = train.__getitems__(picks)
    assert np.array_equal(batch.x.numpy(), x[picks]) and batch.y.tolist() == y[picks].tolist()
    val_split = H5Split(files, "val/x", "val/y")
    assert np.array_equal(val_split.__getitems__(np.arange(90)).x.numpy(), tx)
    train.close()
    val_split.close()


def test_the_class_count_is_said_checked_and_can_be_given(arrays, capsys):
    """Labels 1..10 for ten classes make 11 (class 0 empty): said at conversion and written to the
    shards; --num-classes checks every label against it and is what training reads."""
    d, x, y, tx, ty = arrays
    np.save(d / "shifted.npy", y % 6 + 1)  # labels 1..6: class 0 never used
    val = ["--val-x", str(d / "tx.npy"), "--val-y", str(d / "ty.npy")]
    assert main(["numpy", "--x", str(d / "x.npy"), "--y", str(d / "shifted.npy"), *val, "--out", str(d / "a")]) == 0
    said = capsys.readouterr()
    assert "7 classes); train with" in said.out and "no training sample has label 0; if there are 6 classes, relabel them 0..5" in said.err
    assert inspect_hdf5(resolve_data_files(DataConfig(path=str(d / "a"))), DataConfig()).num_classes == 7
    assert main(["numpy", "--x", str(d / "x.npy"), "--y", str(d / "y.npy"), *val, "--num-classes", "12", "--out", str(d / "b")]) == 0
    assert inspect_hdf5(resolve_data_files(DataConfig(path=str(d / "b"))), DataConfig()).num_classes == 12
    capsys.readouterr()
    assert main(["numpy", "--x", str(d / "x.npy"), "--y", str(d / "y.npy"), *val, "--num-classes", "5", "--out", str(d / "c")]) == 2
    assert f"train label {int(y.max())} is outside 0..4 (--num-classes=5)" in capsys.readouterr().err and not (d / "c").exists()


def test_bad_numpy_input_is_one_line_and_leaves_nothing(arrays, capsys):
    d, *_ = arrays
    VAL = ["--val-x", str(d / "tx.npy"), "--val-y", str(d / "ty.npy")]  # noqa: N806
    np.save(d / "objects.npy", np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    np.save(d / "floats.npy", np.zeros(1000))
    np.savez(d / "archive.npz", x=np.zeros((3, 2)))
    cases = [
        (["--x", str(d / "objects.npy"), "--y", str(d / "y.npy")], "is not a plain .npy array"),
        (["--x", str(d / "x.npy"), "--y", str(d / "floats.npy")], "labels must be a 1-D integer array"),
        (["--x", str(d / "x.npy"), "--y", str(d / "ty.npy")], "has 1000 rows but"),
        (["--x", str(d / "x.npy"), "--y", str(d / "y.npy"), "--test-x", str(d / "tx.npy"), "--test-y", str(d / "ty.npy")], "give --val-x and --val-y"),
        (["--x", str(d / "x.npy"), "--y", str(d / "y.npy"), *VAL, "--test-x", str(d / "tx.npy")], "give both --test-x and --test-y"),
        (["--x", str(d / "missing.npy"), "--y", str(d / "y.npy")], "does not exist"),
        (["--x", str(d), "--y", str(d / "y.npy")], "cannot be read"),
        (["--x", str(d / "archive.npz"), "--y", str(d / "y.npy")], "an .npz archive?"),
    ]
    tests = ["--val-x", str(d / "tx.npy"), "--val-y", str(d / "ty.npy")]
    for args, message in cases:
        given = args if "--val-x" in args or "--test-x" in args else [*args, *tests]
        assert main(["numpy", *given, "--out", str(d / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
        assert not (d / "out").exists() and not list(d.glob(".out.*"))
    (d / "taken").mkdir()
    assert main(["numpy", "--x", str(d / "x.npy"), "--y", str(d / "y.npy"), *tests, "--out", str(d / "taken")]) == 2
    assert "exists" in capsys.readouterr().err


def test_an_interrupted_conversion_leaves_nothing(arrays, monkeypatch):
    d, *_ = arrays
    from trainers.data import convert

    def fail(*args, **kwargs):
        raise KeyboardInterrupt("Ctrl-C mid-shard")

    monkeypatch.setattr(convert, "_write_split", fail)
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C mid-shard"):
        main(["numpy", "--x", str(d / "x.npy"), "--y", str(d / "y.npy"), "--val-x", str(d / "tx.npy"), "--val-y", str(d / "ty.npy"), "--out", str(d / "out")])
    assert sorted(p.name for p in d.iterdir()) == ["tx.npy", "ty.npy", "x.npy", "y.npy"]


def image_folder(root, sizes):
    rng = np.random.default_rng(1)
    for label, name in enumerate(("cat", "dog", "eel")):
        (root / name).mkdir(parents=True)
        for i, (h, w) in enumerate(sizes):
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            pixels[..., 0] = 40 * label  # the class is visible in the red channel
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_an_image_folder_is_decoded_once_to_uint8_shards(tmp_path):
    folder = image_folder(tmp_path / "images", [(20, 30), (33, 17), (16, 16), (40, 40)])
    (folder / "cat" / "notes.txt").write_text("not an image")  # skipped: not an image suffix
    out = tmp_path / "shards"
    tested = image_folder(tmp_path / "held-out", [(12, 12)])
    assert main(["images", str(folder), "--size", "16", "--val-fraction", "0.25", "--test", str(tested), "--workers", "2", "--out", str(out)]) == 0
    files = resolve_data_files(DataConfig(path=str(out / "*.h5")))
    info = inspect_hdf5(files, DataConfig())
    assert (info.num_train, info.num_val, info.input_shape, info.num_classes, info.num_test) == (9, 3, (3, 16, 16), 3, 3)
    with h5py.File(files[1]) as f:  # test-, train-, val-
        assert json.loads(f.attrs["classes"]) == ["cat", "dog", "eel"]
        x, y = f["train/x"][:], f["train/y"][:]
        assert x.dtype == np.uint8 and f["train/x"].attrs["scale"] == pytest.approx(1 / 255)
    assert np.array_equal(x[:, 0].reshape(len(y), -1).max(axis=1), 40 * y)  # labels follow the folders


def test_an_undecodable_image_is_named(tmp_path, capsys):
    folder = image_folder(tmp_path / "images", [(8, 8)])
    (folder / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    assert main(["images", str(folder), "--size", "8", "--workers", "1", "--out", str(tmp_path / "out")]) == 2
    assert "give --val VAL_FOLDER or --val-fraction" in capsys.readouterr().err  # evaluation needs one
    assert main(["images", str(folder), "--size", "8", "--val-fraction", "0.5", "--workers", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "broken.jpg cannot be decoded as an image" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
