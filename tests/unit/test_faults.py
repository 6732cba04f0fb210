"""trainers.faults and RunDir's end record: what a refused write is, how it is told, and where a
run's end is recorded when result.json cannot be written. The real file systems (a full and a
read-only tmpfs under a 2-rank run) are tests/mpi/test_disk_full.py's."""

from __future__ import annotations

import errno
import json
import os

import pytest

from hpc.rundir import RunDir
from trainers.checkpoint.checkpointer import CheckpointError
from trainers.faults import Fault, FaultLatch, size_text, storage_error
from trainers.reporting.metrics import MetricsWriter


@pytest.mark.parametrize(("count", "text"), [(0, "0 B"), (1023, "1023 B"), (92 * 1024, "92 KiB"), (int(2.25 * 2**20), "2.2 MiB"), (24 * 2**20, "24 MiB")])
def test_sizes_read_as_a_person_would_write_them(count, text):
    assert size_text(count) == text


def test_a_refused_write_is_found_inside_the_error_that_wraps_it_and_nothing_else_is():
    full = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise full
        except OSError as err:
            raise CheckpointError("writing the checkpoint failed") from err
    except CheckpointError as wrapped:
        assert storage_error(wrapped) is full
    assert storage_error(FileNotFoundError(errno.ENOENT, "gone")) is None and storage_error(ValueError("x")) is None


def test_the_latch_keeps_the_first_fault_with_its_path_and_lets_other_errors_pass(tmp_path):
    latch = FaultLatch()
    assert not latch.note(PermissionError(errno.EACCES, "Permission denied"), tmp_path)
    assert latch.note(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path / "steps.jsonl")
    assert latch.note(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "later")))
    assert latch.first == Fault(errno.EDQUOT, str(tmp_path / "steps.jsonl"))
    line = latch.first.line()
    assert line.startswith("disk quota exceeded on /") and line.endswith(f"writing {tmp_path / 'steps.jsonl'}") and " free of " in line


def test_a_metrics_file_the_disk_refuses_is_noted_once_and_written_no_more(tmp_path, monkeypatch):
    import trainers.reporting.metrics as metrics

    latch = FaultLatch()
    monkeypatch.setattr(metrics, "FAULTS", latch)
    writer = MetricsWriter(tmp_path / "steps.jsonl")
    writer.write({"step": 1})
    real = writer._file
    assert real is not None

    class Full:
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            real.close()

    writer._file = Full()  # type: ignore[assignment]
    writer.write({"step": 2})  # noted, not raised
    writer.write({"step": 3})  # nothing more is tried
    writer.close()
    assert latch.first == Fault(errno.ENOSPC, str(tmp_path / "steps.jsonl"))
    assert [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()] == [1]


def test_an_end_goes_to_result_json_then_the_reserved_end_json_then_this_machines_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "node"))
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.reserve_end_record()
    assert run.read_result() == {} and run.end_record.stat().st_size == 8192

    assert run.write_result({"status": "stopped", "exit_code": 75}) == run.result
    refuse = {"result"}

    def write_json(path, data):  # noqa: ANN001, ANN202 - RunDir.write_json's shape, on a disk that refuses some names
        if path.stem in refuse:
            raise OSError(errno.ENOSPC, "No space left on device")
        path.write_text(json.dumps(data))

    monkeypatch.setattr(RunDir, "write_json", lambda self, path, data: write_json(path, data))
    failed = {"status": "failed", "exit_code": 1, "reason": "disk full", "error": "x" * 3000}
    assert run.write_result(failed) == run.end_record  # in place, in the space reserved at the start
    assert run.end_record.stat().st_size == 8192 and run.read_result() == failed  # newer than result.json

    run.end_record.unlink()  # a read-only file system: nothing in the run dir takes a write
    assert run.write_result({**failed, "reason": "read-only file system"}) == run.end_fallback
    assert run.end_fallback.is_relative_to(tmp_path / "node") and run.read_result()["reason"] == "read-only file system"
    os.utime(run.end_fallback, (1, 1))  # a later start completed: its result.json is the newest word
    assert run.read_result()["status"] == "stopped"
