"""nanoGPT's own train.py under torchrun against the same script with the run handle under launch.py.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    python benchmarks/nanogpt_handle.py --nanogpt /tmp/nanoGPT [--ranks 2] [--iters 500] [--repeats 2] [--write docs/benchmarks.md]

Both variants run a copy of the checkout's train.py, model.py and configurator.py with nanoGPT's
CPU configuration of its character-level Shakespeare model (4 layers, 4 heads, 128 wide, 64
characters of context, batch 12 per rank, dropout 0), on a character data set made here from
CPython's own documentation (no download: the machines have no network), in nanoGPT's layout
(train.bin, val.bin, meta.pkl). The copies differ from the checkout as little as they can:
- both: the DDP device is the CPU when there is no GPU (nanoGPT's DDP path assumes CUDA);
- the handle's variant adds four lines: `start_run(model=..., optimizer=...)` after the optimizer
  is made (its step is the iteration to start from), `run.end_step(loss=...)` after each
  iteration (stop when it says so), and `run.finish()` at the end; it runs under
  `python launch.py script=train.py resources.tasks_per_node=N -- <nanoGPT's arguments>`.
Figures: tokens/s from nanoGPT's own per-iteration times (rank 0's `iter N: ... time T ms`
lines; the median, leaving out the first five and the evaluation iterations), and the
validation loss nanoGPT prints at each evaluation. The variants alternate which goes first.
nanoGPT's code is read from the checkout given, never copied into this repository.
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATASET = "pydocs_char"
TRAIN_ARGS = [
    "config/train_shakespeare_char.py",
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--backend=gloo",
    "--eval_iters=20",
    "--log_interval=1",
    "--block_size=64",
    "--batch_size=12",
    "--n_layer=4",
    "--n_head=4",
    "--n_embd=128",
    "--dropout=0.0",
    f"--dataset={DATASET}",
]

# (what the checkout's train.py says, what the copy says instead): each must occur exactly once.
ON_CPU = [
    (
        "    device = f'cuda:{ddp_local_rank}'\n    torch.cuda.set_device(device)\n",
        "    device = f'cuda:{ddp_local_rank}' if torch.cuda.is_available() else 'cpu'\n    if torch.cuda.is_available(): torch.cuda.set_device(device)\n",
    ),
    ("    model = DDP(model, device_ids=[ddp_local_rank])\n", "    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)\n"),
]
WITH_HANDLE = [
    (
        "checkpoint = None # free up memory\n",
        "checkpoint = None # free up memory\nfrom hpc.run import start_run\nrun = start_run(model=model, optimizer=optimizer)\niter_num = run.step\n",
    ),
    ("    iter_num += 1\n    local_iter_num += 1\n", "    iter_num += 1\n    local_iter_num += 1\n    if run.end_step(loss=loss.detach()):\n        break\n"),
    ("if ddp:\n    destroy_process_group()", "run.finish()\nif ddp:\n    destroy_process_group()"),
]


def edited(text: str, edits: list[tuple[str, str]], checkout: Path) -> str:
    for before, after in edits:
        if text.count(before) != 1:
            known = "use karpathy/nanoGPT at 3adf61e"
            raise SystemExit(f"{checkout}/train.py is not the nanoGPT train.py this benchmark knows (looked for {before.strip()!r}); {known}")
        text = text.replace(before, after)
    return text


def make_dataset(folder: Path) -> int:
    """nanoGPT's character data layout (as its shakespeare_char/prepare.py writes): uint16 ids,
    and meta.pkl with the vocabulary, which nanoGPT's train.py reads for the model's size."""
    from pydoc_data.topics import topics

    import numpy as np

    text = "\n".join(topics[k] for k in sorted(topics))
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    folder.mkdir(parents=True, exist_ok=True)
    cut = len(ids) * 9 // 10
    ids[:cut].tofile(folder / "train.bin")
    ids[cut:].tofile(folder / "val.bin")
    with (folder / "meta.pkl").open("wb") as f:  # written for nanoGPT to read; nothing here unpickles
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    return len(chars)


def prepared(checkout: Path, into: Path, handle: bool) -> Path:
    into.mkdir(parents=True)
    for name in ("model.py", "configurator.py"):
        shutil.copy(checkout / name, into / name)
    shutil.copytree(checkout / "config", into / "config")
    text = edited((checkout / "train.py").read_text(), ON_CPU + (WITH_HANDLE if handle else []), checkout)
    (into / "train.py").write_text(text)
    return into


def figures(output: str, eval_interval: int) -> dict[str, object]:
    times = {int(m[1]): float(m[2]) for m in re.finditer(r"\biter (\d+): loss [\d.]+, time ([\d.]+)ms", output, re.M)}
    losses = {int(m[1]): float(m[2]) for m in re.finditer(r"\bstep (\d+): train loss [\d.]+, val loss ([\d.]+)", output, re.M)}
    steady = [t for i, t in times.items() if i >= 5 and i % eval_interval]
    if not steady or not losses:
        raise SystemExit(f"no iteration times or evaluations in nanoGPT's output:\n{output[-1500:]}")
    return {"iter_ms": statistics.median(steady), "val": losses, "iters": max(times)}


def one_run(handle: bool, args: argparse.Namespace, tmp: Path, index: int) -> dict[str, object]:
    work = prepared(args.nanogpt, tmp / f"run-{index}", handle)
    (work / "data").symlink_to(tmp / "data")
    schedule = [f"--max_iters={args.iters}", f"--lr_decay_iters={args.iters}", f"--eval_interval={args.eval_interval}", f"--out_dir={work / 'out'}"]
    schedule.append(f"--gradient_accumulation_steps={args.ranks}")  # nanoGPT divides it by the world size: one micro-step per rank
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    if handle:
        command = [sys.executable, str(ROOT / "launch.py"), "script=train.py", f"resources.tasks_per_node={args.ranks}", f"run_root={work / 'runs'}"]
        command += ["--", *TRAIN_ARGS, *schedule]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks), "train.py", *TRAIN_ARGS, *schedule]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    output = done.stdout + done.stderr  # launch.py passes the script's prints through
    if done.returncode != 0:
        raise SystemExit(f"a run failed (exit {done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return figures(output, args.eval_interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of github.com/karpathy/nanoGPT")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--eval-interval", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", type=Path, help="append the figures to this markdown file")
    args = parser.parse_args()
    if not (args.nanogpt / "train.py").is_file() or not (args.nanogpt / "model.py").is_file():
        raise SystemExit(f"--nanogpt {args.nanogpt}: no nanoGPT checkout there (train.py and model.py); git clone https://github.com/karpathy/nanoGPT")
    tokens_per_iter = args.ranks * 12 * 64
    runs: dict[bool, list[dict[str, object]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        vocab = make_dataset(Path(tmp) / "data" / DATASET)
        for repeat in range(args.repeats):
            for handle in (False, True) if repeat % 2 == 0 else (True, False):
                result = one_run(handle, args, Path(tmp), 2 * repeat + handle)
                runs[handle].append(result)
                name = "launch.py + run handle" if handle else "torchrun, nanoGPT as is"
                print(f"repeat {repeat + 1}: {name}: {tokens_per_iter / float(result['iter_ms']) * 1000:.0f} tokens/s, val loss {result['val']}", flush=True)
    rate = {h: [tokens_per_iter / float(r["iter_ms"]) * 1000 for r in rs] for h, rs in runs.items()}
    ratios = [ours / theirs for ours, theirs in zip(rate[True], rate[False], strict=True)]
    last = max(runs[False][0]["val"])  # type: ignore[arg-type]
    val_theirs = statistics.median(r["val"][last] for r in runs[False])  # type: ignore[index]
    val_ours = statistics.median(r["val"][last] for r in runs[True])  # type: ignore[index]
    lines = [
        f"### nanoGPT's train.py with the run handle against nanoGPT under torchrun ({date.today()}, {platform.node()}, {os.cpu_count()} cores)",
        "",
        f"`python benchmarks/nanogpt_handle.py --nanogpt <karpathy/nanoGPT checkout> --ranks {args.ranks} --iters {args.iters} --repeats {args.repeats}`: "
        f"nanoGPT's CPU Shakespeare-char configuration (4x4x128, context 64, batch 12 per rank, {vocab}-character vocabulary), "
        f"{args.ranks} ranks, {tokens_per_iter} tokens per iteration, variants interleaved.",
        "",
        "| | tokens/s per repeat | val loss at step " + str(last) + " (median) |",
        "|---|---|---|",
        f"| nanoGPT under torchrun | {', '.join(f'{r:.0f}' for r in rate[False])} | {val_theirs:.4f} |",
        f"| nanoGPT + run handle under launch.py | {', '.join(f'{r:.0f}' for r in rate[True])} | {val_ours:.4f} |",
        "",
        f"Tokens/s, handle / torchrun per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; median **{statistics.median(ratios):.3f}x** (goal >= 1.0x). "
        f"Validation loss at step {last}: {100 * (val_ours / val_theirs - 1):+.2f} % (goal within 2 %).",
        "",
    ]
    print("\n".join(lines))
    if args.write:
        with args.write.open("a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
