"""The device checks' summary as Markdown: pure, from the summary's JSON.

A check's entry: status (ok, failed, timed out, killed, skipped, not run, running), seconds and
budget_s, figures (name -> value), targets (name -> {value, target, met}), pairs (name -> a
toolkit run against its reference over interleaved rounds: benchmarks/device/rounds.py's
summarize), tables (Markdown blocks), notes, error."""

from __future__ import annotations

from typing import Any


def render_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, list):
        return ", ".join(render_value(v) for v in value)
    return str(value)


def render_check(name: str, check: dict[str, Any]) -> list[str]:
    timing = f", {check['seconds']:.0f} s of {check['budget_s']:.0f}" if "seconds" in check else ""
    lines = [f"## {name}: {check.get('status', '?')}{timing}", ""]
    if check.get("error"):
        lines += [f"error: {check['error']}", ""]
    targets = check.get("targets") or {}
    if targets:
        lines += ["| target | value | wanted | met |", "| --- | --- | --- | --- |"]
        for target, row in targets.items():
            lines.append(f"| {target} | {render_value(row['value'])} | {row['target']} | {'yes' if row['met'] else 'NO'} |")
        lines.append("")
    for pair, entry in (check.get("pairs") or {}).items():
        lines += render_pair_rounds(pair, entry)
    figures = check.get("figures") or {}
    if figures:
        lines += ["| figure | value |", "| --- | --- |"]
        lines += [f"| {figure} | {render_value(value)} |" for figure, value in figures.items()]
        lines.append("")
    for table in check.get("tables") or []:
        lines += [table, ""]
    lines += [f"- {note}" for note in check.get("notes") or []]
    return lines


def ratio_text(spread: dict[str, float]) -> str:
    return f"{spread['median']:.3f}x ({spread['min']:.3f}..{spread['max']:.3f})"


def pair_row(pair: str, e: dict[str, Any]) -> str:
    unit = e["unit"]
    cells = [pair, f"{e['rounds']} of {e['rounds_asked']}", f"{render_value(e['toolkit_median'])} {unit}", f"{render_value(e['reference_median'])} {unit}"]
    cells += [f"**{e['ratio']['median']:.3f}x**", f"{e['ratio']['min']:.3f}..{e['ratio']['max']:.3f}", e["target"], "yes" if e["met"] else "NO"]
    wait = e.get("data_wait")
    cells += [f"{wait['median']:.2%} (max {wait['max']:.2%})", wait["target"], "yes" if wait["met"] else "NO"] if wait else ["n/a", "", ""]
    return "| " + " | ".join(cells) + " |"


def render_pairs(checks: dict[str, Any]) -> list[str]:
    """One row per pair of every check: the table issue 43's "Done means" asks for."""
    rows = [pair_row(pair, entry) for check in checks.values() for pair, entry in (check.get("pairs") or {}).items()]
    if not rows:
        return []
    head = [
        "## Toolkit against its reference, interleaved rounds (median ratio and spread)",
        "",
        "| pair | rounds | toolkit (median) | reference (median) | ratio | spread | target | met | data wait (median) | target | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    return [*head, *rows, ""]


def render_pair_rounds(pair: str, entry: dict[str, Any]) -> list[str]:
    lines = [f"{pair}, {entry['unit']}: toolkit / reference {ratio_text(entry['ratio'])} over {entry['rounds']} of {entry['rounds_asked']} rounds", ""]
    lines += [f"- toolkit: {entry['toolkit_does']}", f"- reference: {entry['reference_does']}"]
    lines += [f"- {name}: {ratio_text(spread)}" for name, spread in entry.get("others", {}).items()]
    lines += ["", "| round | first | toolkit | reference | ratio | data wait | s |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in entry["rows"]:
        wait = f"{row['data_wait_share']:.2%}" if row.get("data_wait_share") is not None else "n/a"
        cells = [row["round"], row["first"], render_value(row["toolkit"]), render_value(row["reference"]), f"{row['ratio']:.3f}", wait, row["seconds"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return [*lines, ""]


def render_markdown(summary: dict[str, Any]) -> str:
    checks = summary.get("checks", {})
    head = [
        f"# Device checks ({summary.get('mode', '?')} mode), {summary.get('started', '?')}, {summary.get('host', '?')}, {summary.get('cores', '?')} cores",
        "",
        f"`{summary.get('command', '')}`" + (f", {summary['seconds']:.0f} s in all" if "seconds" in summary else ""),
        "",
        "| check | status | seconds |",
        "| --- | --- | --- |",
    ]
    head += [f"| {name} | {c.get('status', '?')} | {c.get('seconds', '')} |" for name, c in checks.items()]
    body: list[str] = ["", *render_pairs(checks)]
    for name, check in checks.items():
        body += render_check(name, check)
    return "\n".join(head + body).rstrip() + "\n"
