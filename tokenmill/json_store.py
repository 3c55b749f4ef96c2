"""A JSON object kept in one file of the cache (trials, verdicts, run parts, engine calls): read whole, and
rewritten whole through a temporary file renamed over it, so a reader in another process sees the old
object or the new one, never half of one."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable


def read_json(path: Path) -> dict[str, Any]:
    """The object in `path`; empty where there is none, or none that parses (a cache starts again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def rewrite_json(path: Path, change: Callable[[dict[str, Any]], None], indent: int | None = None) -> None:
    """The object in `path` (read_json), changed in place by `change`, written whole and renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = read_json(path)
    change(stored)
    temporary = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(json.dumps(stored, indent=indent))
    temporary.replace(path)  # atomic: a concurrent reader sees old or new
