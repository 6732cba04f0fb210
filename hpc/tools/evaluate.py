"""A run's checkpoint evaluated again, on its validation or test split, apart from its training.

    python -m hpc.evaluate RUN_DIR [--step N | --best] [--split val|test] [--out FILE]

The job's own task and model (its config.yaml: the built-in task or a user task), the chosen
committed checkpoint's weights (the newest by default; a damaged one is skipped for the one
before, as a resume does; in a run dir's object store too), and the task's own evaluation on one
process. Prints one line of figures and writes them as JSON (`--out`, by default
RUN_DIR/eval/step-N-SPLIT.json). As a job in a pipeline, after the training:

    python launch.py cluster=... script=hpc.evaluate after=JOB -- RUN_DIR --split test

A script's run (script=...) keeps its own model code: evaluate it in the script. Errors are one
line each, exit code 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hpc.cli import Parser
from hpc.errors import UserError
from hpc.rundir import RunDir

SPLITS = ("val", "test")


def evaluate_run(run_dir: Path, step: int | None = None, best: bool = False, split: str = "val") -> dict[str, Any]:
    """{"step", "split", "samples", "metrics"} of the chosen checkpoint on `split`."""
    from omegaconf import OmegaConf

    from collectives.base import SingleProcess
    from hpc.config.schema import to_job_config
    from hpc.rank.task import job_task
    from trainers.checkpoint.checkpointer import CheckpointError
    from trainers.checkpoint.export import ExportError, checkpoint_model
    from trainers.checkpoint.storage import StoreError
    from trainers.evaluation import evaluate
    from trainers.task import Place

    run = RunDir(run_dir)
    if not run.config.is_file():
        raise UserError(f"{run_dir} is not a run dir (no {run.config.name} in it)")
    job = to_job_config(OmegaConf.load(run.config))
    if job.script:
        raise UserError(f"{run_dir} ran a script ({job.script}): its model is the script's own; evaluate it there")
    try:
        checkpoint, _, _, weights = checkpoint_model(run_dir, step, best)
    except (ExportError, CheckpointError, StoreError) as err:
        raise UserError(str(err)) from None
    task = job_task(job)
    comm = SingleProcess()
    task.set_place(Place(comm.rank, comm.world_size, comm.device))
    model = task.build_model()
    model.load_state_dict(weights)
    data = task.test_data() if split == "test" else task.eval_data()
    if data is None:
        raise UserError(f"--split {split}: the task has no {split} split")
    metrics = evaluate(task, model, data, comm, job.data.batch_size, comm.device)
    return {"step": checkpoint.step, "split": split, "samples": len(data), "metrics": metrics}


def main(argv: list[str]) -> int:
    parser = Parser("python -m hpc.evaluate", __doc__ or "")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the training's run dir")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="this checkpoint step instead of the newest")
    which.add_argument("--best", action="store_true", help="the checkpoint checkpoint.best kept")
    parser.add_argument("--split", choices=SPLITS, default="val", help="the split evaluated (default: val)")
    parser.add_argument("--out", type=Path, help="the JSON file to write (default: RUN_DIR/eval/step-N-SPLIT.json)")
    args = parser.parse_args(argv)
    try:
        found = evaluate_run(args.run_dir, args.step, args.best, args.split)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    out = args.out or args.run_dir / "eval" / f"step-{found['step']}-{found['split']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(found, indent=1) + "\n")
    figures = " ".join(f"{name}={value:.6g}" for name, value in found["metrics"].items())
    print(f"checkpoint step {found['step']}, {found['split']} split ({found['samples']} samples): {figures}; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
