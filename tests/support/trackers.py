"""What a run left in its trackers: one MLflow run and one W&B run (offline files), each holding
every step once."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.wandb_files import history


def one_tracker_run_each(where: Path, run_dir: Path, steps: int, starts: int) -> None:
    """The toolkit's run is one MLflow run (MLFLOW_TRACKING_URI, default experiment) and one W&B
    run (offline dirs under `where`/wandb, one per start), each with train/loss at steps
    1..`steps` once: no gap, no repeat."""
    from mlflow import MlflowClient

    client = MlflowClient()
    (run,) = client.search_runs(["0"])
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, steps + 1))
    wandb_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]["id"]
    assert len(list((where / "wandb").glob(f"offline-run-*-{wandb_id}*"))) == starts
    rows = [row for row in history(where / "wandb", wandb_id) if "train/loss" in row]
    assert [row["_step"] for row in rows] == list(range(1, steps + 1)), per_start(where / "wandb", wandb_id)


def per_start(wandb_dir: Path, run_id: str) -> str:
    """Which steps each start's offline files hold, as ranges: what a failed check shows."""
    lines = []
    for run in sorted(wandb_dir.glob(f"offline-run-*-{run_id}*")):
        held = [row["_step"] for row in history(wandb_dir, run_id, run.name) if "train/loss" in row]
        lines.append(f"{run.name}: {spans(held)}")
    return "\n".join(lines)


def spans(steps: list[int]) -> str:
    out: list[list[int]] = []
    for step in steps:
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out)
