"""Token data for language models: text -> a 1-D token array per split in HDF5, and the
map-style data set of fixed-length windows a language-model task trains on.

    python -m trainers.tokens --out corpus.h5                 # the embedded corpus (no network)
    python -m trainers.tokens --out corpus.h5 a.txt b.txt     # your own text files

Layout: `train/tokens` and `val/tokens`, each a 1-D uint8 array, with the attributes
`tokenizer` ("bytes") and `vocab_size` (256) on the file. The tokenizer is UTF-8 bytes: no
vocabulary file, no download, and every text round-trips exactly. The embedded corpus is the
English reference text every CPython installation ships (`pydoc_data.topics`, about 470 kB).

Window i of a split is tokens[i*context : i*context + context + 1]: the inputs are its first
`context` tokens and the targets the same shifted by one. Windows are addressed by a global
index, so the toolkit's sampler keeps owning the exact data position across restarts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np

TOKENIZER = "bytes"
VOCAB_SIZE = 256
SPLITS = ("train", "val")


class TokenDataError(ValueError):
    """Token data that cannot be made or used; the message names the cause and the fix."""


def embedded_corpus() -> str:
    """CPython's own English reference text (the `help()` topics), sorted by topic name."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: np.ndarray) -> str:
    return np.asarray(tokens, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")


EMBEDDED_FILE = "cpython-docs-tokens.h5"


def embedded_token_path() -> Path:
    """The embedded corpus as a token file in the cache dir, written once (atomically)."""
    from trainers.data.datasets import cache_dir

    path = cache_dir() / EMBEDDED_FILE
    if not path.exists():
        write_token_file(embedded_corpus(), path)
    return path


def resolve_token_path(tokens: str | None) -> Path:
    """The absolute token file ranks will read: `tokens`, or the embedded corpus when None."""
    if tokens is None:
        return embedded_token_path()
    path = Path(tokens).expanduser().resolve()
    if not path.is_file():
        raise TokenDataError(f"task.tokens={tokens}: no such file (make one with python -m trainers.tokens --out {tokens} TEXT...)")
    return path


def write_token_file(text: str, out: Path, val_fraction: float = 0.1) -> dict[str, int]:
    """Encode `text`, keep its last `val_fraction` for validation, write `out` (through a
    temporary file and a rename: an interrupted run leaves no half-written file). Returns the
    token count per split."""
    if not 0 < val_fraction < 1:
        raise TokenDataError(f"--val-fraction {val_fraction} must be between 0 and 1")
    tokens = encode(text)
    split_at = int(len(tokens) * (1 - val_fraction))
    counts = {"train": split_at, "val": len(tokens) - split_at}
    if min(counts.values()) < 2:
        raise TokenDataError(f"{len(tokens)} tokens are too few to split into train and val; give more text")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")  # two writers never share one
    with h5py.File(partial, "w") as f:
        f.attrs["tokenizer"] = TOKENIZER
        f.attrs["vocab_size"] = VOCAB_SIZE
        f.create_dataset("train/tokens", data=tokens[:split_at])
        f.create_dataset("val/tokens", data=tokens[split_at:])
    partial.replace(out)
    return counts


def has_split(path: Path, split: str) -> bool:
    """Whether the token file holds `split` (an optional held-out "test" split, say)."""
    with h5py.File(path, "r") as f:
        return f"{split}/tokens" in f


class TokenWindows:
    """Map-style data set of one split: item i is (inputs, targets), two int64 tensors of
    `context` tokens, the targets shifted by one. The split is read into memory once."""

    draws_random = False  # reading draws no random numbers: read ahead on a thread (trainers/rngstreams.py)

    def __init__(self, path: Path, split: str, context: int) -> None:
        if context < 1:
            raise TokenDataError(f"context length {context} must be >= 1")
        with h5py.File(path, "r") as f:
            if f.attrs.get("tokenizer") != TOKENIZER or f"{split}/tokens" not in f:
                raise TokenDataError(f"{path} is not a token file with a {split!r} split (make one with python -m trainers.tokens)")
            self.tokens = np.asarray(f[f"{split}/tokens"][:], dtype=np.int64)
        self.context = context
        if len(self) < 1:
            raise TokenDataError(f"the {split} split of {path} has {len(self.tokens)} tokens: fewer than one window of {context} + 1")

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.context

    def __getitem__(self, index: int) -> tuple[object, object]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[object, object]]:
        import torch

        windows = self.windows(np.asarray(indices, dtype=np.int64))
        return [(torch.from_numpy(w[:-1]), torch.from_numpy(w[1:])) for w in windows]

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """The windows (context + 1 tokens each) at these indices, as one array."""
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"window index outside 0..{len(self) - 1}")
        starts = indices * self.context
        return self.tokens[starts[:, None] + np.arange(self.context + 1)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.tokens", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", nargs="*", type=Path, help="UTF-8 text files, joined in order (default: the embedded corpus)")
    parser.add_argument("--out", type=Path, required=True, help="the HDF5 file to write")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="the share of tokens, from the end, kept for validation (default 0.1)")
    args = parser.parse_args(argv)
    try:
        text = "\n\n".join(path.read_text(encoding="utf-8") for path in args.texts) if args.texts else embedded_corpus()
        counts = write_token_file(text, args.out, args.val_fraction)
    except (OSError, UnicodeDecodeError, TokenDataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {counts['train']} train and {counts['val']} val tokens ({TOKENIZER} tokenizer, vocabulary {VOCAB_SIZE})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
