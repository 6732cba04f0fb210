"""The device checks' summary as Markdown: pure, from the summary's JSON.

A check's entry: status (ok, failed, timed out, killed, skipped, not run, running), seconds and
budget_s, figures (name -> value), targets (name -> {value, target, met}), tables (Markdown
blocks), notes, error."""

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
    figures = check.get("figures") or {}
    if figures:
        lines += ["| figure | value |", "| --- | --- |"]
        lines += [f"| {figure} | {render_value(value)} |" for figure, value in figures.items()]
        lines.append("")
    for table in check.get("tables") or []:
        lines += [table, ""]
    lines += [f"- {note}" for note in check.get("notes") or []]
    return lines


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
    body: list[str] = [""]
    for name, check in checks.items():
        body += render_check(name, check)
    return "\n".join(head + body).rstrip() + "\n"
