"""The language-model parts: the token file (text -> HDF5, the embedded corpus, windows by
global index) and the GPT-style model (causal, trainable on the corpus in a few steps)."""

from __future__ import annotations

import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from tests.support.runs import ROOT
from trainers.data.tokens import VOCAB_SIZE, TokenDataError, TokenWindows, decode, embedded_corpus, write_token_file
from trainers.gpt import GPT, GPTShape, next_token_loss


def test_text_round_trips_through_the_token_file(tmp_path):
    text = "Grüße, naïve café — ok\n" * 50
    counts = write_token_file(text, tmp_path / "t.h5", val_fraction=0.2)
    with h5py.File(tmp_path / "t.h5") as f:
        train, val = f["train/tokens"][:], f["val/tokens"][:]
        assert f.attrs["vocab_size"] == VOCAB_SIZE and train.dtype == np.uint8
    assert counts == {"train": len(train), "val": len(val)} and len(val) == len(text.encode()) - int(len(text.encode()) * 0.8)
    assert decode(np.concatenate([train, val])) == text
    assert not list(tmp_path.glob(".*partial"))


def test_windows_are_addressed_by_global_index_and_targets_shift_by_one(tmp_path):
    write_token_file("".join(chr(ord("a") + i % 26) for i in range(1000)), tmp_path / "t.h5")
    windows = TokenWindows(tmp_path / "t.h5", "train", context=16)
    assert len(windows) == (900 - 1) // 16
    x, y = windows[3]
    assert decode(x.numpy()) == "".join(chr(ord("a") + i % 26) for i in range(48, 64))
    assert torch.equal(x[1:], y[:-1]) and x.dtype == torch.int64
    batch = windows.__getitems__([5, 0, 5])
    assert torch.equal(batch[0][0], batch[2][0]) and torch.equal(batch[1][0], windows[0][0])
    with pytest.raises(IndexError, match="window index outside"):
        windows[len(windows)]


def test_bad_token_input_is_one_line(tmp_path):
    with pytest.raises(TokenDataError, match="too few to split"):
        write_token_file("a", tmp_path / "t.h5")
    with pytest.raises(TokenDataError, match="--val-fraction 1.5 must be between 0 and 1"):
        write_token_file("abcdef", tmp_path / "t.h5", val_fraction=1.5)
    with h5py.File(tmp_path / "images.h5", "w") as f:
        f.create_dataset("train/x", data=np.zeros(4))
    with pytest.raises(TokenDataError, match="is not a token file with a 'train' split"):
        TokenWindows(tmp_path / "images.h5", "train", 8)


def test_the_converter_command_writes_the_embedded_corpus_and_refuses_bad_input(tmp_path):
    done = subprocess.run([sys.executable, "-m", "trainers.tokens", "--out", str(tmp_path / "c.h5")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "train and" in done.stdout
    with h5py.File(tmp_path / "c.h5") as f:
        assert decode(np.concatenate([f["train/tokens"][:], f["val/tokens"][:]])) == embedded_corpus()
    missing = subprocess.run(
        [sys.executable, "-m", "trainers.tokens", "--out", str(tmp_path / "d.h5"), str(tmp_path / "nope.txt")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "nope.txt" in missing.stderr
    assert not (tmp_path / "d.h5").exists()


def test_the_model_is_causal():
    torch.manual_seed(0)
    model = GPT(GPTShape(context=12, layers=2, heads=2, width=16)).eval()
    tokens = torch.randint(0, 256, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256  # a different future
    with torch.no_grad():
        assert torch.allclose(model(tokens)[:, :7], model(changed)[:, :7], atol=1e-6)
        assert not torch.allclose(model(tokens)[:, 7:], model(changed)[:, 7:])


def test_bad_model_shapes_are_refused():
    with pytest.raises(ValueError, match="width=30 must be a multiple of heads=4"):
        GPT(GPTShape(width=30, heads=4))
    with pytest.raises(ValueError, match="13 tokens are more than the context of 12"):
        GPT(GPTShape(context=12, width=16, heads=2))(torch.zeros(1, 13, dtype=torch.long))


def test_the_loss_falls_on_the_embedded_corpus(tmp_path):
    write_token_file(embedded_corpus(), tmp_path / "c.h5")
    windows = TokenWindows(tmp_path / "c.h5", "train", context=32)
    torch.manual_seed(0)
    model = GPT(GPTShape(context=32, layers=2, heads=2, width=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(60):
        batch = windows.__getitems__(rng.integers(0, len(windows), 16).tolist())
        x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        loss = next_token_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # about log(256) = 5.5 at the start
    assert np.mean(losses[-10:]) < 0.7 * losses[0]


def test_a_token_task_reports_tokens_per_second_beside_samples(tmp_path, caplog):
    import logging

    from tests.support.fit_in_process import Regression, config, train
    from trainers.reporting.metrics import read_metrics
    from trainers.tasks.lm import LanguageModelTask

    tokens = tmp_path / "tokens.h5"
    write_token_file(embedded_corpus()[:40_000], tokens, 0.1)
    with caplog.at_level(logging.INFO, logger="trainers"):
        train(tmp_path / "lm", LanguageModelTask(tokens=str(tokens), context=16, layers=1, heads=1, width=8), config())
    (epoch, *_) = read_metrics(tmp_path / "lm" / "metrics.jsonl")
    assert epoch["tokens_per_s"] == pytest.approx(epoch["samples_per_s"] * 16)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 1/"))
    assert "val_loss" in line and f"tokens/s {epoch['tokens_per_s']:.0f}" in line
    train(tmp_path / "regression", Regression(), config())
    assert all("tokens_per_s" not in row for row in read_metrics(tmp_path / "regression" / "metrics.jsonl"))
