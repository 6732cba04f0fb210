"""The object store goes away in the middle of a real 2-rank run (checkpoint.uri on a real
S3-compatible server behind a proxy the test cuts): the save under way fails in one line after
its retries, nothing half-written is ever resumed, and once the server is back the run resumes
from the newest checkpoint committed before the cut and finishes."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.support.runs import resume_command, start_launch, wait_for_run
from tests.support.tcp_fault import CuttableProxy
from trainers.checkpoint.checkpointer import Checkpointer
from trainers.checkpoint.storage import ObjectStore, stored_checkpoints

pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("needs_mpi")]

# Saves every 2 steps, 66 steps in all: the cut lands while saves still come
JOB = ["model.hidden_sizes=[256,256]", "trainer.epochs=3", "checkpoint.every_steps=2", "checkpoint.every_minutes=null", "checkpoint.keep=2"]


def committed(run_dir, direct: str) -> list[int]:
    """The run's committed steps, read from the server itself (not through the proxy)."""
    located = stored_checkpoints(run_dir / "checkpoints")
    assert isinstance(located, ObjectStore)
    os.environ["AWS_ENDPOINT_URL"], through = direct, os.environ["AWS_ENDPOINT_URL"]
    try:
        return ObjectStore(located.url, run_dir / "checkpoints" / "test-reads").committed_steps()
    finally:
        os.environ["AWS_ENDPOINT_URL"] = through


def test_a_store_cut_mid_run_fails_the_save_and_the_run_resumes_from_the_last_commit(s3, tmp_path, monkeypatch):
    direct = os.environ["AWS_ENDPOINT_URL"]
    proxy = CuttableProxy(("127.0.0.1", int(direct.rsplit(":", 1)[1])))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)  # the ranks reach the server through the proxy
    try:
        launched = start_launch(*JOB, f"checkpoint.uri={s3}", cwd=tmp_path)
        run_dir = wait_for_run(launched, tmp_path, lambda run: (run / "checkpoints" / "STORE").is_file() and len(committed(run, direct)) >= 2, "2 saves")
        proxy.sever()
        assert launched.wait(timeout=180) != 0
        log = (run_dir / "logs" / "rank-00000.log").read_text() + (run_dir / "logs" / "rank-00001.log").read_text()
        line = r"(writing|committing) the checkpoint failed: .* \(s3://[^)]*\) failed after 5 attempts: .*; the previous committed checkpoint is intact"
        failed = re.search(line, log)
        assert failed, log[-3000:]
        assert os.environ["AWS_SECRET_ACCESS_KEY"] not in log
        newest = committed(run_dir, direct)[-1]
        proxy.mend()

        command, env = resume_command(run_dir)
        resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        logs = "".join(f"\n--- rank {rank}:\n" + (run_dir / "logs" / f"rank-0000{rank}.log").read_text()[-1500:] for rank in (0, 1))
        assert resumed.returncode == 0, resumed.stderr[-1500:] + logs  # a rank's own error is in its log
        result = json.loads((run_dir / "result.json").read_text())
        assert result["status"] == "completed" and result["resumed_from"] == newest
        store = stored_checkpoints(run_dir / "checkpoints")
        assert Checkpointer(store, 0, 2, keep=2).load_latest()[0] == result["steps"]
    finally:
        proxy.close()
