"""A toolkit run against its reference in interleaved rounds (issue 43: "5 interleaved rounds of
the same command with the median ratio and its spread"): round 1 runs the toolkit first, round 2
the reference first, and so on, each side where it runs (launch.py's processes; the reference in
the check's own process or under torchrun). Per pair: the ratio toolkit / reference of every
round, their median and spread (min..max), the toolkit's share of step time spent waiting for
data (its metrics.jsonl: data_wait_ms / step_ms), and whether each target is met.

A pair's summary is saved as soon as a round ends, and no round starts that the check's budget
cannot hold (estimated by the fastest round so far): a check cut short still reports the rounds it
finished, and says how many of those asked for ran (a target of its own)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks.device.report import Report

DATA_WAIT_TARGET = 0.02  # issue 43: the toolkit waits for data less than 2% of its step time


@dataclass(frozen=True)
class Measured:
    """One side of one round."""

    rate: float  # samples (images, tokens) per second, the pair's unit
    data_wait_share: float | None = None  # the toolkit's data_wait_ms / step_ms, where it reports them
    others: dict[str, float] = field(default_factory=dict)  # further references measured beside (name -> rate)
    variants: dict[str, float] = field(default_factory=dict)  # the toolkit's rate measured other ways (name -> rate), over the reference


@dataclass
class Pair:
    name: str
    unit: str
    target: float  # toolkit / reference, the median over rounds, at least this
    toolkit: str  # what the toolkit side does, in words (the report says it)
    reference: str  # what the reference side does
    run_toolkit: Callable[[int], Measured]  # called with the round's index (0-based)
    run_reference: Callable[[int], Measured]
    rows: list[dict[str, Any]] = field(default_factory=list)


def sides_in_round(index: int) -> tuple[str, str]:
    """Round 1 (index 0): the toolkit first; round 2: the reference first; and so on."""
    return ("toolkit", "reference") if index % 2 == 0 else ("reference", "toolkit")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def round_row(index: int, order: tuple[str, str], toolkit: Measured, reference: Measured, seconds: float) -> dict[str, Any]:
    return {
        "round": index + 1,
        "first": order[0],
        "toolkit": toolkit.rate,
        "reference": reference.rate,
        "ratio": toolkit.rate / reference.rate,
        "data_wait_share": toolkit.data_wait_share,
        "others": {
            **{f"toolkit / {name}": toolkit.rate / rate for name, rate in reference.others.items()},
            **{f"toolkit, {name} / reference": rate / reference.rate for name, rate in toolkit.variants.items()},
        },
        "seconds": round(seconds, 1),
    }


def summarize(pair: Pair, rounds_asked: int) -> dict[str, Any]:
    """The pair's entry in the report (pure: from its rows)."""
    rows = pair.rows
    ratio = spread([r["ratio"] for r in rows])
    summary: dict[str, Any] = {
        "unit": pair.unit,
        "toolkit_does": pair.toolkit,
        "reference_does": pair.reference,
        "rounds": len(rows),
        "rounds_asked": rounds_asked,
        "rows": rows,
        "toolkit_median": statistics.median(r["toolkit"] for r in rows),
        "reference_median": statistics.median(r["reference"] for r in rows),
        "ratio": ratio,
        "target": f">= {pair.target}",
        "met": ratio["median"] >= pair.target,
        "others": {name: spread([r["others"][name] for r in rows]) for name in rows[0]["others"]},
    }
    waits = [r["data_wait_share"] for r in rows if r["data_wait_share"] is not None]
    if waits:
        summary["data_wait"] = {**spread(waits), "target": f"< {DATA_WAIT_TARGET:.0%}", "met": statistics.median(waits) < DATA_WAIT_TARGET}
    return summary


def record(report: Report, pair: Pair, rounds_asked: int) -> None:
    """The pair's summary and its targets (which set the check's status: "missed a target")."""
    summary = summarize(pair, rounds_asked)
    report.pair(pair.name, summary)
    ratio = summary["ratio"]
    report.target(f"{pair.name}: toolkit / reference, median of the rounds", ratio["median"], summary["target"], summary["met"])
    if "data_wait" in summary:
        wait = summary["data_wait"]
        report.target(f"{pair.name}: toolkit's step time waiting for data, median", wait["median"], wait["target"], wait["met"])
    report.target(f"{pair.name}: rounds finished", len(pair.rows), f">= {rounds_asked}", len(pair.rows) >= rounds_asked)


def interleave(pairs: list[Pair], rounds: int, report: Report) -> None:
    """`rounds` rounds of every pair, the sides' order alternating; each pair recorded after each round."""
    fastest = float("inf")
    for index in range(rounds):
        began = time.monotonic()
        for pair in pairs:
            order = sides_in_round(index)
            measured: dict[str, Measured] = {}
            pair_began = time.monotonic()
            for side in order:
                side_began = time.monotonic()
                measured[side] = (pair.run_toolkit if side == "toolkit" else pair.run_reference)(index)
                print(f"round {index + 1}, {pair.name}, {side}: {measured[side].rate:,.0f} {pair.unit} ({time.monotonic() - side_began:.1f} s)", flush=True)
            pair.rows.append(round_row(index, order, measured["toolkit"], measured["reference"], time.monotonic() - pair_began))
            record(report, pair, rounds)
        fastest = min(fastest, time.monotonic() - began)
        left = report.seconds_left()
        print(f"round {index + 1} of {rounds}: {time.monotonic() - began:.1f} s; {left:.0f} s of the check's budget left", flush=True)
        if index + 1 < rounds and left < fastest:
            report.note(f"{index + 1} of {rounds} rounds: another (the fastest took {fastest:.0f} s) would not fit the {left:.0f} s left of the check's budget")
            break
