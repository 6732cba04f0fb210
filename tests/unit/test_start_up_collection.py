"""A rank imports torch and torch._dynamo with Python's cyclic collector off
(hpc.rank.main.import_frameworks): their hundreds of thousands of long-lived objects would be
traversed by collection after collection; once imported they are frozen out of every later
collection, and collection is back on before the user's code runs."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.runs import ROOT

# In a fresh interpreter (this one has torch already): collections counted by gc's callback
PROBE = """
import gc, json, sys
from hpc.rank.main import import_frameworks
assert "torch" not in sys.modules
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
import_frameworks()
print(json.dumps({"collections": len(collections), "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "imported": ["torch" in sys.modules, "torch._dynamo" in sys.modules]}))
"""


def test_torch_and_dynamo_import_without_collections_then_are_frozen_and_collection_is_back_on() -> None:
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    seen = json.loads(probe.stdout)
    assert seen["collections"] == 0 and seen["enabled"] is True and seen["imported"] == [True, True], seen
    assert seen["frozen"] > 100_000, seen  # torch's and dynamo's objects, out of every later collection
