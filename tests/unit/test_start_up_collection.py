"""A rank imports torch with Python's cyclic collector off (hpc.rank.main.import_without_collection):
its hundreds of thousands of long-lived objects would be traversed by collection after
collection; once imported they are frozen out of every later collection (torch._dynamo's import
among them), and collection is back on before the user's code runs."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.runs import ROOT

# In a fresh interpreter (this one has torch already): collections counted by gc's callback
PROBE = """
import gc, json, sys
from hpc.rank.main import import_without_collection
assert "torch" not in sys.modules
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
import_without_collection("torch")
print(json.dumps({"collections": len(collections), "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "imported": "torch" in sys.modules}))
"""


def test_torch_imports_without_collections_then_is_frozen_and_collection_is_back_on() -> None:
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    seen = json.loads(probe.stdout)
    assert seen["collections"] == 0 and seen["enabled"] is True and seen["imported"] is True, seen
    assert seen["frozen"] > 100_000, seen  # torch's objects, out of every later collection
