"""The run directory: one folder per job holding everything about it.

<run_dir>/config.yaml      resolved config the ranks read (data.path made absolute)
<run_dir>/job.sbatch       the sbatch script as submitted (slurm)
<run_dir>/job.json         job id, cluster, submission time
<run_dir>/logs/rank-00000.log   one log per rank, every line carrying the rank
<run_dir>/console.log      rank 0's console, for local ranks the Python API started in the background
<run_dir>/metrics.jsonl    every moment's figures averaged over ranks: epoch ends, validations, the test
                           split, a script's log() (rank 0's run-files sink writes: trainers.reporting.sinks)
<run_dir>/steps.jsonl      per-step loss averaged over ranks (rank 0 writes)
<run_dir>/checkpoints/     committed checkpoints step-000000123/ (see trainers.checkpoint.checkpointer); with
                           checkpoint.uri: STORE (their URL) and the staging of saves in progress
<run_dir>/result.json      final metrics, written by rank 0 when training ends
<run_dir>/end.json         space reserved at the start for the run's end when result.json cannot be
                           written (a full disk or quota: overwritten in place, no new block); a
                           read-only or vanished file system: a node-local copy (end_fallback)
<run_dir>/slurm/           submitit's folder: pickled call, per-task stdout/stderr
<run_dir>/code/            the sources the job runs, frozen at submission (hpc.launching.snapshot)
<run_dir>/heartbeats/      every rank's last finished step, host and pid (trainers.watchdog)
<run_dir>/.hpc-run         the run marker (RUN_MARKER): a run or sweep dir, never frozen as code
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The code ranks run: put first on their PYTHONPATH so a job never needs an installed copy.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# In every run dir and sweep dir the toolkit makes: freezing a script's directory leaves out any
# directory holding it (hpc.config.freezing), wherever run_root or hydra.run.dir put it.
RUN_MARKER = ".hpc-run"
END_RECORD_BYTES = 8192  # end.json's reserved size: a failed run's summary with its one line fits


def mark_run_dir(path: Path) -> None:
    """`path` (made if missing) marked as the toolkit's output: a run or sweep directory."""
    path.mkdir(parents=True, exist_ok=True)
    (path / RUN_MARKER).write_text("a run directory of hpc-toolkit: never frozen with a job's code\n")


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def sbatch(self) -> Path:
        return self.path / "job.sbatch"

    @property
    def job(self) -> Path:
        return self.path / "job.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def console(self) -> Path:
        """Rank 0's console of local ranks started in the background (the Python API)."""
        return self.path / "console.log"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def steps(self) -> Path:
        return self.path / "steps.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def result(self) -> Path:
        return self.path / "result.json"

    @property
    def end_record(self) -> Path:
        return self.path / "end.json"

    @property
    def end_fallback(self) -> Path:
        """Where a run's end goes when its own file system takes no write at all (read-only, gone):
        this machine's temporary directory, read by hpc.status on the same machine."""
        key = hashlib.sha256(str(self.path.absolute()).encode()).hexdigest()[:24]
        return Path(tempfile.gettempdir()) / f"hpc-toolkit-{os.getuid()}" / "ends" / f"{key}.json"

    @property
    def submitit(self) -> Path:
        return self.path / "slurm"

    @property
    def heartbeats(self) -> Path:
        return self.path / "heartbeats"

    @property
    def outcomes(self) -> Path:
        """Where each rank says how its part of a start ended (hpc.rank.outcomes)."""
        return self.path / "outcomes"

    @property
    def code(self) -> Path:
        return self.path / "code"

    @property
    def allreduce_table(self) -> Path:
        """auto's tuning table as this job first used it: a restart must sum in the same order."""
        return self.path / "allreduce-table.json"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank:05d}.log"

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        """Strict JSON (a loss that went NaN is written null, not NaN, which strict parsers
        refuse), replaced in one rename: a reader sees the old file or the new one. The temporary
        name is this process's own: several ranks may write one file (a failure's result.json)."""
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(finite_or_null(data), indent=2, sort_keys=True, allow_nan=False) + "\n")
            tmp.replace(path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk: no empty temporary left behind
            raise

    def read_json(self, path: Path) -> dict[str, Any]:
        return json.loads(path.read_text())

    def reserve_end_record(self) -> None:
        """Rank 0 at the start: end.json's space taken now, while there is some (best effort)."""
        try:
            if not self.end_record.exists():
                self.end_record.write_bytes(b" " * END_RECORD_BYTES)
        except OSError:
            pass

    def write_result(self, summary: dict[str, Any]) -> Path | None:
        """result.json; where the file system refuses it, end.json overwritten in place, then the
        node-local end_fallback. Where it was recorded; None: nowhere (read_result finds it)."""
        try:
            self.write_json(self.result, summary)
            return self.result
        except OSError:
            pass
        text = (json.dumps(finite_or_null(summary), sort_keys=True, allow_nan=False) + "\n").encode()
        try:
            reserved = self.end_record.stat().st_size
            if len(text) <= reserved:
                with self.end_record.open("r+b") as f:  # in place: blocks it already has
                    f.write(text.ljust(reserved, b" "))
                    f.flush()
                    os.fsync(f.fileno())
                return self.end_record
        except OSError:
            pass
        try:
            self.end_fallback.parent.mkdir(parents=True, exist_ok=True)
            self.end_fallback.write_bytes(text)
            return self.end_fallback
        except OSError:
            return None

    def read_result(self) -> dict[str, Any]:
        """The run's newest end: result.json, or end.json / end_fallback where a later end could
        not write result.json (the newest file wins); {} when none says anything."""
        found: list[tuple[float, int, dict[str, Any]]] = []
        for order, path in enumerate((self.result, self.end_record, self.end_fallback)):
            try:
                text, when = path.read_text(), path.stat().st_mtime
                data = json.loads(text) if text.strip() else None
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                found.append((when, order, data))  # written in one clock tick: the fallback is the later word
        return max(found, key=lambda entry: entry[:2])[2] if found else {}


def failure_line(result: dict[str, Any]) -> str:
    """result.json's failure in one line, `rank N: Type: message` (hpc.rank.outcomes writes
    it); empty unless the run failed on a known rank."""
    if result.get("status") != "failed":
        return ""
    reason = f"{result['reason']}: " if result.get("reason") else ""  # "disk full: ": what a user scanning a sweep looks for
    if "failed_rank" not in result:  # the launcher's word on a rank it saw killed (hpc.launching.deaths)
        return f"{reason}{result['error']}" if result.get("error") else ""
    return f"{reason}rank {result['failed_rank']}: {result.get('error', '?')}"


def finite_or_null(value: Any) -> Any:
    """`value` with every NaN or infinite float inside it (dicts, lists, tuples) made None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(item) for item in value]
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file (metrics, steps, timeline); a line cut by a killed job
    is skipped, and a missing file is empty."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def last_record(path: Path) -> dict[str, Any] | None:
    """The last complete JSON line of a metrics file (read from its end: files grow long), or None."""
    found = last_records(path, 1)
    return found[0] if found else None


def last_records(path: Path, count: int) -> list[dict[str, Any]]:
    """Up to the last `count` complete JSON lines of a metrics file, oldest first (from its last 64 KiB)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = f.read().splitlines()
    except OSError:
        return []
    found: list[dict[str, Any]] = []
    for line in reversed(lines):
        if len(found) == count:
            break
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written, or the cut first line
        if isinstance(record, dict):
            found.append(record)
    return found[::-1]


def natural_key(path: Path) -> tuple[tuple[int, int | str], ...]:
    """Sort key reading digit runs as numbers: point 2 before point 10 (sweep point dirs)."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", str(path)) if part)


def find_runs(path: Path) -> list[RunDir]:
    """The run directories at `path`: a sweep's points (sweep.json), one run (config.yaml), or
    every run below it (sorted). Raises UserError when there are none."""
    from hpc.errors import UserError

    if not path.is_dir():
        raise UserError(f"{path} is not a directory")
    sweep = path / "sweep.json"
    if sweep.is_file():
        points = json.loads(sweep.read_text()).get("points", [])
        runs = [RunDir(Path(p["run_dir"])) for p in sorted(points, key=lambda p: p["num"])]
    elif (path / "config.yaml").is_file() or (path / RUN_MARKER).is_file():
        runs = [RunDir(path)]
    else:
        # Hydra's .hydra/ and a frozen code/ copy hold config.yaml files too; they are not runs. A
        # run dir of ranks started by hand (the run handle's) has the marker and no config.yaml; a
        # sweep dir has both marker and sweep.json, and is no run.
        found = {c.parent for c in path.rglob("config.yaml") if not _hidden_or_code(c.relative_to(path).parts[:-1])}
        found |= {m.parent for m in path.rglob(RUN_MARKER) if not _hidden_or_code(m.relative_to(path).parts[:-1]) and not (m.parent / "sweep.json").is_file()}
        runs = sorted((RunDir(p) for p in found), key=lambda r: natural_key(r.path))
    if not runs:
        raise UserError(f"{path} holds no runs (no sweep.json, and no run dir in it or below it)")
    return runs


def _hidden_or_code(parts: tuple[str, ...]) -> bool:
    return any(part.startswith(".") or part == "code" for part in parts)
