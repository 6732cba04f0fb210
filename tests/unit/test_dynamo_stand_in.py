"""torch._dynamo's stand-in (hpc.rank.dynamo), in fresh interpreters (this one may have the real
module): torch's optimizers train through it without the real module, to the same bits as with
it; anything else it cannot answer (a compile, a submodule) loads the real module, after which a
function disabled through the stand-in is disabled for real; introspection loads nothing."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.runs import ROOT

# Every tensor of a short training (parameters, BatchNorm's buffers, each optimizer's state) after
# SGD with momentum, Adam and AdamW, a scheduler, clipping and a state_dict round trip.
TRAIN = """
import hashlib, json, sys, torch
from hpc.rank import dynamo
stood = dynamo.stand_in() if sys.argv[1] == "stand-in" else (__import__("torch._dynamo"), False)[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
digest = hashlib.sha256()
for make in (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), lambda p: torch.optim.Adam(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)):
    optimizer = make(model.parameters())
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, 10)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(6, 8)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
    optimizer.load_state_dict(optimizer.state_dict())
    for state in optimizer.state.values():
        for value in state.values():
            digest.update(torch.as_tensor(value).numpy().tobytes())
for tensor in model.state_dict().values():
    digest.update(tensor.numpy().tobytes())
print(json.dumps({"stood": stood, "module": type(sys.modules["torch._dynamo"]).__name__, "digest": digest.hexdigest()}))
"""

LATER = """
import importlib.util, inspect, json, sys, torch
from hpc.rank import dynamo
assert dynamo.stand_in() and not dynamo.stand_in()
for module in list(sys.modules.values()):  # what inspect.getmodule and pickle do: the stand-in must not import the real one
    getattr(module, "__file__", None), getattr(module, "__all__", None), hasattr(module, "__wrapped__")
found = importlib.util.find_spec("torch._dynamo") is not None
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(3, 4)).sum().backward()
optimizer.step()
before = type(sys.modules["torch._dynamo"]).__name__
compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
value = compiled(torch.ones(2)).tolist()
import torch._dynamo.config
add_param_group = torch.optim.Optimizer.add_param_group.__wrapped__.__dynamo_disable  # the stand-in's, cached by torch
optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
made = [cell.cell_contents for cell in add_param_group.__closure__ if isinstance(cell.cell_contents, list)][0]
print(json.dumps({"found": found, "before": before, "after": type(sys.modules["torch._dynamo"]).__name__,
                  "same": torch._dynamo is sys.modules["torch._dynamo"], "value": value, "config": torch._dynamo.config.cache_size_limit > 0,
                  "disabled_for_real": bool(made) and getattr(made[0], "_torchdynamo_disable", False)}))
"""


def probe(source: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", source, *args], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_optimizers_train_through_the_stand_in_to_the_bits_of_the_real_module():
    stood, real = probe(TRAIN, "stand-in"), probe(TRAIN, "real")
    assert stood["stood"] is True and stood["module"] == "StandIn", stood  # the real module never imported
    assert real["module"] == "module", real
    assert stood["digest"] == real["digest"]


def test_a_compile_loads_the_real_module_and_what_the_stand_in_disabled_is_disabled_for_real():
    seen = probe(LATER)
    assert seen["found"] is True and seen["before"] == "StandIn", seen  # introspection and the optimizer's step loaded nothing
    assert seen["after"] == "module" and seen["same"] is True and seen["config"] is True, seen
    assert seen["value"] == [3.0, 3.0]
    assert seen["disabled_for_real"] is True, seen
