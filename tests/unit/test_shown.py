"""Swept values as printed: short where Optuna or a float range wrote 17 digits, exact elsewhere."""

from __future__ import annotations

from hpc.launching.sweep import SweepPoint
from hpc.launching.trials import _label
from hpc.shown import shown_override, shown_value
from hpc.tools.status import swept_label


def test_long_floats_print_in_four_significant_digits_and_everything_else_as_written():
    cases = {
        "0.0012345678901234567": "0.001235",
        "0.30000000000000004": "0.3",
        "1.2345678901234567e-05": "1.235e-05",
        "0.1": "0.1",
        "1e-3": "1e-3",
        "100000000": "100000000",  # an int keeps its digits
        "resnet50": "resnet50",
        "[16,32,64,128]": "[16,32,64,128]",
        "nan.value.x": "nan.value.x",
    }
    assert {text: shown_value(text) for text in cases} == cases
    assert shown_override("optim.lr=0.0012345678901234567") == "optim.lr=0.001235" and shown_override("+x") == "+x"


def test_the_launcher_and_hpc_status_print_a_drawn_lr_short():
    point = SweepPoint(4, ("optim.lr=0.0012345678901234567", "model=mlp"), None, 6)  # type: ignore[arg-type]
    assert "optim.lr=0.001235" in _label(point)
    assert swept_label({"optim.lr": "0.0012345678901234567"}) == "optim.lr=0.001235"
