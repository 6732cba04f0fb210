"""What a job script's values may hold, for every scheduler: one line of printable characters,
and job ids in the scheduler's own form (after=, after_any=)."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from hpc.config.launchers import LauncherTraits
from hpc.errors import UserError

# Control characters (C0, DEL, C1 such as NEL) and Unicode line/paragraph separators: each can
# end a line for some reader of a job script (Python's splitlines, editors, log viewers).
CONTROL_CATEGORIES = ("Cc", "Zl", "Zp")


def has_control_character(text: str) -> bool:
    return any(unicodedata.category(ch) in CONTROL_CATEGORIES for ch in text)


def job_ids(key: str, value: Any, launcher: LauncherTraits) -> list[str]:
    """`after`/`after_any` as `launcher`'s job ids: one id, a list (after=[123,124]) or a text of
    ids separated by commas or colons (after="123,124"); UserError for anything else."""
    if value is None or value == "" or value == []:
        return []
    items = value if isinstance(value, list | tuple) else re.split(r"[,:]", str(value))
    ids = [str(item).strip() for item in items]
    bad = [item for item in ids if not re.fullmatch(launcher.job_id_form, item)]
    if bad or isinstance(value, bool):
        one, two, task = launcher.job_id_examples
        raise UserError(f"{key}={value!r}: name {launcher.scheduler} job ids, e.g. {key}={one} or {key}=[{one},{two}] (an array's task: {task})")
    return ids
