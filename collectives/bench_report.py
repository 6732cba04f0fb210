"""The allreduce benchmark's arithmetic and reports: pure functions over the launches' records.

A launch record: {"impl", "round", "results": [{"bytes", "time_us", "max_error"}],
"memory": [{"bytes", "copy_gbs", "add_gbs"}]}. Implementations are compared by the median over
rounds, and by per-round ratios (a round runs every implementation once, back to back), which
cancel the drift of a shared machine better than ratios of medians. A ratio is called faster or
slower only when the order-statistics interval of its median lies on one side of 1: the same
code in two launches differed by 10-15% on the development VM.

The physical bound: a shared-memory allreduce where every rank reads its peers' buffers in
place reduces its 1/p share with (p-1) adds of n/p bytes and gathers the other shares with
(p-1) copies of n/p bytes, so t >= (p-1)/p * n * (1/add + 1/copy), which is a busbw of at most
2 / (1/add + 1/copy), whatever p. add and copy are the bandwidths every rank measured at the
same time, in the same launch (GB/s of destination bytes).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s, as nccl-tests defines them for allreduce."""
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    return algbw, algbw * 2 * (world - 1) / world


def bound_busbw(copy_gbs: float, add_gbs: float) -> float:
    """The busbw a shared-memory allreduce reading peers in place could reach (module doc)."""
    if copy_gbs <= 0 or add_gbs <= 0:
        return 0.0
    return 2 / (1 / add_gbs + 1 / copy_gbs)


def human(nbytes: int) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}iB"
    return f"{nbytes} B"


def summarize(launches: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Medians over rounds per implementation and size, the memory bound per size, and auto's
    per-round speed ratio against every other implementation."""
    times: dict[tuple[str, int], dict[int, float]] = {}
    errors: dict[tuple[str, int], float] = {}
    for launch in launches:
        for r in launch["results"]:
            key = (launch["impl"], r["bytes"])
            times.setdefault(key, {})[launch["round"]] = r["time_us"]
            errors[key] = max(errors.get(key, 0.0), r["max_error"])
    rows: list[dict[str, Any]] = []
    for (impl, nbytes), by_round in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        median_us = statistics.median(by_round.values())
        algbw, busbw = bus_bandwidth(nbytes, median_us / 1e6, world)
        rows.append(
            {
                "impl": impl,
                "bytes": nbytes,
                "time_us": median_us,
                "time_us_min": min(by_round.values()),
                "time_us_max": max(by_round.values()),
                "rounds": len(by_round),
                "algbw_gbs": algbw,
                "busbw_gbs": busbw,
                "max_error": errors[impl, nbytes],
            }
        )
    memory: dict[int, dict[str, list[float]]] = {}
    for launch in launches:
        for m in launch.get("memory", []):
            slot = memory.setdefault(m["bytes"], {"copy": [], "add": []})
            slot["copy"].append(m["copy_gbs"])
            slot["add"].append(m["add_gbs"])
    bound: dict[int, dict[str, float]] = {}
    for nbytes, slot in sorted(memory.items()):
        copy, add = statistics.median(slot["copy"]), statistics.median(slot["add"])
        bound[nbytes] = {"copy_gbs": copy, "add_gbs": add, "bound_busbw_gbs": bound_busbw(copy, add)}
    for row in rows:
        limit = bound[row["bytes"]]["bound_busbw_gbs"] if row["bytes"] in bound else 0.0
        row["of_bound"] = row["busbw_gbs"] / limit if limit else None
    return {"rows": rows, "bound": bound, "auto_ratios": ratios(times, "auto")}


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(low, high, coverage): the distribution-free interval for the median from order
    statistics (the sign test's), the narrowest whose coverage is at least `confidence`, else
    the full range with the coverage it has (5 samples: min-max, 94%; 9 samples: 2nd-8th, 96%).
    No normality assumed: one stalled launch in a round is an outlier, not a shift."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no values")

    def coverage(k: int) -> float:  # of [k-th smallest, k-th largest]: 1 - 2 P(Binomial(n, 1/2) < k)
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while 2 * (k + 1) <= n + 1 and coverage(k + 1) >= confidence:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


CONFIDENCE = 0.9  # below it (fewer than 5 rounds) no cell is called faster or slower


def verdict(low: float, high: float, coverage: float) -> str:
    """'faster' when the whole interval of their time / ours is above 1, 'slower' when below,
    'par' when it holds 1; 'unknown' when too few rounds give the interval no confidence."""
    if coverage < CONFIDENCE:
        return "unknown"
    return "faster" if low > 1 else "slower" if high < 1 else "par"


def ratios(times: dict[tuple[str, int], dict[int, float]], ours: str) -> list[dict[str, Any]]:
    """Per size and other implementation: other's time / ours's, paired within each round
    (> 1: ours is faster), as the median, the range and the median's interval over rounds."""
    out = []
    for (impl, nbytes), by_round in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        mine = times.get((ours, nbytes))
        if impl == ours or mine is None:
            continue
        paired = [by_round[r] / mine[r] for r in by_round if r in mine and mine[r] > 0]
        if paired:
            low, high, coverage = median_interval(paired)
            out.append(
                {
                    "vs": impl,
                    "bytes": nbytes,
                    "median": statistics.median(paired),
                    "min": min(paired),
                    "max": max(paired),
                    "low": low,
                    "high": high,
                    "coverage": coverage,
                    "verdict": verdict(low, high, coverage),
                    "rounds": len(paired),
                }
            )
    return out


def render_markdown(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    rows = summary["rows"]
    impls = list(dict.fromkeys(r["impl"] for r in sorted(rows, key=lambda r: _order(r["impl"]))))
    sizes = sorted({r["bytes"] for r in rows})
    by_key = {(r["impl"], r["bytes"]): r for r in rows}
    bound = summary["bound"]
    lines = [
        f"{meta['world_size']} ranks on {meta['hosts']} ({meta['cpu_count']} cores), {meta['date']}: `{meta['command']}`",
        f"({meta['layout']}; median over {meta['rounds']} rounds; max error over all sizes: "
        f"{max((r['max_error'] for r in rows), default=0.0):.1e}; not run: {', '.join(meta['not_run']) or 'none'})",
        "",
        "busbw in GB/s, and in parentheses the fraction of the shared-memory bound (copy and add measured by every rank at once in the same launches):",
        "",
        "| size | " + " | ".join(impls) + " | bound (copy, add) |",
        "| --- |" + " --- |" * (len(impls) + 1),
    ]
    for size in sizes:
        cells = []
        for impl in impls:
            row = by_key.get((impl, size))
            share = row and row["of_bound"]
            cells.append("" if row is None else f"{row['busbw_gbs']:.2f}" + (f" ({share:.2f})" if share else ""))
        limit = bound.get(size)
        tail = f"{limit['bound_busbw_gbs']:.1f} ({limit['copy_gbs']:.1f}, {limit['add_gbs']:.1f})" if limit else ""
        lines.append(f"| {human(size)} | " + " | ".join(cells) + f" | {tail} |")
    others = [i for i in impls if i != "auto"]
    by_ratio = {(r["vs"], r["bytes"]): r for r in summary["auto_ratios"]}
    if others and by_ratio:
        coverage = min(r["coverage"] for r in summary["auto_ratios"])
        lines += [
            "",
            "auto's speed against each: their time / auto's, paired by round; the median, and in brackets the interval that holds "
            f"the median with {coverage:.0%} confidence (order statistics); above 1 auto is faster:",
            "",
        ]
        lines += ["| size | " + " | ".join(others) + " |", "| --- |" + " --- |" * len(others)]
        for size in sizes:
            cells = []
            for impl in others:
                r = by_ratio.get((impl, size))
                cells.append("" if r is None else f"{r['median']:.2f} [{r['low']:.2f}-{r['high']:.2f}]" + _MARK[r["verdict"]])
            lines.append(f"| {human(size)} | " + " | ".join(cells) + " |")
        lines += ["", _verdicts(summary["auto_ratios"])]
    if meta.get("auto_choices"):
        lines += ["", f"auto's table ({meta['auto_tuning']}): {meta['auto_choices']}"]
    return "\n".join(lines) + "\n"


_MARK = {"faster": " +", "slower": " -", "par": "", "unknown": ""}


def _verdicts(ratios: list[dict[str, Any]]) -> str:
    if any(r["verdict"] == "unknown" for r in ratios):
        return f"Too few rounds to call auto faster or slower with {CONFIDENCE:.0%} confidence: 5 or more are needed."
    slower = [f"{r['vs']} at {human(r['bytes'])}" for r in ratios if r["verdict"] == "slower"]
    faster = sum(r["verdict"] == "faster" for r in ratios)
    return (
        f"auto is slower, with that confidence (marked -), than: {', '.join(slower) or 'none'}; faster (marked +) in {faster} of {len(ratios)} "
        "cells; in the others the two cannot be told apart."
    )


def _order(impl: str) -> int:
    known = ("auto", "ring", "rhd", "hierarchical", "mpi", "gloo", "horovod")
    return known.index(impl) if impl in known else len(known)


def crossover(rows: Iterable[dict[str, Any]], faster: str = "ring", slower: str = "rhd") -> int | None:
    """The smallest size from which `faster` beats `slower` at every larger size."""
    rows = list(rows)
    sizes = sorted({r["bytes"] for r in rows})
    times = {(r["impl"], r["bytes"]): r["time_us"] for r in rows}
    if not all((name, s) in times for s in sizes for name in (faster, slower)):
        return None
    for size in sizes:
        if all(times[faster, s] < times[slower, s] for s in sizes if s >= size):
            return size
    return None


def plot(summary: dict[str, Any], meta: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = summary["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in sorted(dict.fromkeys(r["impl"] for r in rows), key=_order):
        mine = sorted((r for r in rows if r["impl"] == impl), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in mine], [r["busbw_gbs"] for r in mine], marker="o", label=impl)
    if summary["bound"]:
        sizes = sorted(summary["bound"])
        ax.plot(sizes, [summary["bound"][s]["bound_busbw_gbs"] for s in sizes], "k--", label="shared-memory bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(f"allreduce, {meta['world_size']} ranks, {meta['hosts']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
